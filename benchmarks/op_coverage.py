"""Which ATen ops each zoo model's training step contains, and which have sharding rules.

    python benchmarks/op_coverage.py                 # every model: ops, rule or not
    python benchmarks/op_coverage.py llama resnet    # some models
    python benchmarks/op_coverage.py --missing       # only the ops without a rule

From code: ``from op_coverage import ops_of; ops_of("llama")`` (with benchmarks/ on the
path) gives the op names of the tiny LLaMA's joint graph, captured on meta.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys

import torch

import torchalpa.models as models
from torchalpa.frontends.torch_export import capture


@functools.cache
def op_counts(model_name: str) -> dict[str, int]:
    """Op name -> how many nodes of the tiny model's joint graph run it."""
    workload = models.tiny(model_name)
    with torch.device("meta"):
        model = workload.build()
        batch = workload.example_inputs()
    graph = capture(model, batch, workload.loss_fn).graph
    return dict(collections.Counter(n.op for n in graph.ops()))


def ops_of(model_name: str) -> set[str]:
    """The op names in the joint forward+backward graph of zoo model ``model_name``."""
    return set(op_counts(model_name))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=sorted(models.FAMILIES),
                        help=f"zoo models (default: all of {sorted(models.FAMILIES)})")
    parser.add_argument("--missing", action="store_true", help="print only ops without a rule")
    args = parser.parse_args()
    import torchalpa.passes.rules.boundaries  # noqa: F401  (until rules/__init__ imports it)
    from torchalpa.passes.rules import has_rule

    without_rule: dict[str, list[str]] = collections.defaultdict(list)
    for name in args.models:
        counts = op_counts(name)
        covered = sum(1 for op in counts if has_rule(op))
        print(f"\n{name}: {len(counts)} ops, {covered} with a rule, "
              f"{sum(counts.values())} nodes")
        for op in sorted(counts):
            if not has_rule(op):
                without_rule[op].append(name)
            if args.missing and has_rule(op):
                continue
            print(f"  {'rule' if has_rule(op) else '----'}  {op}  x{counts[op]}")
    print(f"\nops without a rule ({len(without_rule)}):")
    for op in sorted(without_rule):
        print(f"  {op}: {', '.join(without_rule[op])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
