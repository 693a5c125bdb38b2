"""torchalpa's command line.

    torchalpa coverage                          # every model of the zoo (torchalpa.models)
    torchalpa coverage --model llama --model resnet
    torchalpa coverage --model mypkg.train:workload

``coverage`` captures each model's training step (forward, loss and backward) on the
``meta`` device -- no weights are allocated -- and prints which of its ATen ops have a
sharding rule and which do not (those run replicated on every device), with how many
nodes of the graph run each op. A model is a zoo family name (its tiny config) or
``module:callable``, where the callable returns a ``torchalpa.models.Workload`` or a tuple
``(model, example_inputs, loss_fn)``; it is called under ``torch.device("meta")``.
The exit status is 1 if an op has no rule or a model fails to capture.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import sys
from typing import Callable

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchalpa", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    coverage = commands.add_parser(
        "coverage", help="which ops of each model's training step have sharding rules",
        description="Capture each model's training step on the meta device and list its ops, "
                    "with or without a sharding rule. A model is a zoo family (its tiny "
                    "config) or module:callable returning a Workload or "
                    "(model, example_inputs, loss_fn).")
    coverage.add_argument("--model", action="append", metavar="NAME",
                          help="a zoo family or module:callable (repeatable; default: the zoo)")
    coverage.set_defaults(run=_coverage)
    from torchalpa.cli_stablehlo import add_commands
    add_commands(commands)       # plan --stablehlo, export
    args = parser.parse_args(argv)
    return args.run(args)


def _zoo():
    try:
        return importlib.import_module("torchalpa.models")
    except ImportError as e:
        raise SystemExit(f"torchalpa coverage: the model zoo (torchalpa.models) is not "
                         f"available ({e}); name models as module:callable instead") from e


def _loader(spec: str) -> Callable[[], tuple]:
    """``() -> (model, example_inputs, loss_fn)`` for a zoo name or ``module:callable``."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            make = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load {spec!r}: {e}") from e
    else:
        zoo = _zoo()
        if spec not in zoo.FAMILIES:
            raise ValueError(f"unknown model {spec!r}; the zoo has {sorted(zoo.FAMILIES)} "
                             "(or pass module:callable)")

        def make():
            return zoo.tiny(spec)

    def load():
        made = make()
        if hasattr(made, "build") and hasattr(made, "example_inputs"):
            return made.build(), made.example_inputs(), made.loss_fn
        model, example_inputs, loss_fn = made
        return model, example_inputs, loss_fn
    return load


def _coverage(args) -> int:
    import torch

    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.rules import rule_for

    names = args.model or sorted(_zoo().FAMILIES)
    failed = False
    without: dict[str, list[str]] = collections.defaultdict(list)
    for name in names:
        try:
            with torch.device("meta"):
                model, example_inputs, loss_fn = _loader(name)()
            graph = capture(model, example_inputs, loss_fn).graph
        except Exception as e:  # report every model, then fail
            print(f"\n{name}: could not capture: {type(e).__name__}: {e}")
            failed = True
            continue
        nodes = collections.Counter(n.op for n in graph.ops())
        missing = sorted({n.op for n in graph.ops() if rule_for(n, graph) is None})
        print(f"\n{name}: {len(nodes)} ops in {sum(nodes.values())} nodes, "
              f"{len(nodes) - len(missing)} with a sharding rule, {len(missing)} without")
        for op in sorted(nodes):
            print(f"  {'----' if op in missing else 'rule'}  {op:64s} x{nodes[op]}")
        for op in missing:
            without[op].append(name)
    print(f"\nops without a sharding rule (run replicated): {len(without) or 'none'}")
    for op in sorted(without):
        print(f"  {op}: {', '.join(without[op])}")
    return 1 if failed or without else 0


if __name__ == "__main__":
    raise SystemExit(main())
