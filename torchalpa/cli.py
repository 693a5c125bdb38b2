"""torchalpa's command line.

    torchalpa coverage                          # every model of the zoo (torchalpa.models)
    torchalpa coverage --model llama --model resnet
    torchalpa coverage --model mypkg.train:workload
    torchalpa coverage --hf                     # the suite of models torchalpa was not written for

``coverage`` captures each model's training step (forward, loss and backward) on the
``meta`` device -- no weights are allocated -- and prints which of its ATen ops have a
sharding rule and which do not (those run replicated on every device), with how many
nodes of the graph run each op. A model is a zoo family name (its tiny config) or
``module:callable`` (or ``path/to/file.py:callable``), where the callable returns a
``torchalpa.models.Workload`` or a tuple ``(model, example_inputs, loss_fn)``; it is
called under ``torch.device("meta")``.
The exit status is 1 if an op has no rule or a model fails to capture.
"""

from __future__ import annotations

import argparse
import collections
import importlib
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
    coverage.add_argument("--hf", action="store_true",
                          help="the suite of transformers architectures and PyTorch idioms "
                               "(torchalpa.models.suite), with a summary table")
    coverage.set_defaults(run=_coverage)
    args = parser.parse_args(argv)
    return args.run(args)


def _zoo():
    try:
        return importlib.import_module("torchalpa.models")
    except ImportError as e:
        raise SystemExit(f"torchalpa coverage: the model zoo (torchalpa.models) is not "
                         f"available ({e}); name models as module:callable instead") from e


def _loader(spec: str) -> Callable[[], tuple]:
    """``() -> (model, example_inputs, loss_fn)`` for a zoo name, ``suite:NAME`` (a case of
    ``torchalpa.models.suite``) or ``module:callable``."""
    if spec.startswith("suite:"):
        from torchalpa.models.suite import build_case
        name = spec.partition(":")[2]
        return lambda: build_case(name)
    if ":" in spec:
        module_name, _, attr = spec.rpartition(":")
        make = getattr(_import(module_name, spec), attr, None)
        if make is None or not callable(make):
            raise ValueError(f"cannot load {spec!r}: {module_name} has no callable {attr!r}")
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
        import torch
        if not (isinstance(made, tuple) and len(made) == 3
                and isinstance(made[0], torch.nn.Module)
                and isinstance(made[1], (tuple, list))
                and (made[2] is None or callable(made[2]))):
            raise ValueError(f"{spec} returned {type(made).__name__} {str(made)[:60]!r}; it must "
                             "return a torchalpa.models.Workload or a tuple (model: nn.Module, "
                             "example_inputs: tuple of tensors, loss_fn or None)")
        return made
    return load


def _import(module_name: str, spec: str):
    """A module by dotted name, or a ``.py`` file by path (``./train.py:make``)."""
    import importlib.util
    import os
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        if not os.path.isfile(module_name):
            raise ValueError(f"cannot load {spec!r}: no file {module_name}")
        name = os.path.splitext(os.path.basename(module_name))[0]
        file_spec = importlib.util.spec_from_file_location(name, module_name)
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot load {spec!r}: {e} (give module:callable, or path/to/file.py:"
                         "callable)") from e


def _coverage(args) -> int:
    import torch

    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.rules import rule_for

    names = list(args.model or ())
    if args.hf:
        from torchalpa.models.suite import SUITE
        names += [f"suite:{name}" for name in SUITE]
    names = names or sorted(_zoo().FAMILIES)
    failed = False
    without: dict[str, list[str]] = collections.defaultdict(list)
    table: list[tuple[str, str, str]] = []
    for name in names:
        try:
            with torch.device("meta"):
                model, example_inputs, loss_fn = _loader(name)()
            graph = capture(model, example_inputs, loss_fn).graph
        except Exception as e:  # report every model, then fail
            print(f"\n{name}: could not capture: {type(e).__name__}: {e}")
            table.append((name, "FAILS", f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"))
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
        table.append((name, "captures", f"{sum(nodes.values())} nodes" + (
            f", replicated: {', '.join(missing)}" if missing else "")))
    if any(name.startswith("suite:") for name in names):
        _print_suite_table([row for row in table if row[0].startswith("suite:")])
    print(f"\nops without a sharding rule (run replicated): {len(without) or 'none'}")
    for op in sorted(without):
        print(f"  {op}: {', '.join(without[op])}")
    return 1 if failed or without else 0


def _print_suite_table(rows: list[tuple[str, str, str]]) -> None:
    from torchalpa.models.suite import SUITE
    print("\nmodel                  family           capture   notes")
    for name, status, notes in rows:
        case = SUITE.get(name.partition(":")[2])
        family = case.family if case else "-"
        known = f" (known: {case.known_failure[:60]}...)" if case and case.known_failure \
            and status == "FAILS" else ""
        print(f"{name.partition(':')[2] or name:22s} {family:16s} {status:9s} {notes}{known}")
    print(f"{sum(s == 'captures' for _, s, _ in rows)} of {len(rows)} capture")


if __name__ == "__main__":
    raise SystemExit(main())
