"""Where a one-stage published row's estimated compute goes, op by op, and its collectives.

    cd benchmarks && python compute_by_op.py megatron20-a100-8b
    python compute_by_op.py llmc-gpt2-124m-a100x8 --by-producer

Plans the row as ``published.py`` does (its plan pinned; rows with ``pp == 1``) and prints
the estimate, then the compute the estimate sums (``op_compute_seconds`` of each op under
its chosen strategy, times the micro-batches) by op and phase, and the plan's collectives
by kind, phase and mesh axis (count, MiB). ``--by-producer`` also splits each op by the op
that made its first operand (views looked through): a bias ``add`` reading a matmul's
result apart from a residual ``add``, which tells what a framework that runs some ops
inside another's kernel (a GEMM's epilogue) would not pay. Minutes per row on the CPU VM.
"""

from __future__ import annotations

import collections
import sys

import published as P
from published_rows import ROWS

import torchalpa.passes.sharding.sharding_plan as sharding_plan


def producer(graph, node) -> str:
    """The op that made ``node``'s first operand, views looked through ("" for a leaf)."""
    if not node.operands:
        return ""
    made = graph.node(node.operands[0].node)
    while made.aliases and made.operands:
        made = graph.node(made.operands[0].node)
    return "" if made.is_leaf else made.op


def main(key: str, by_producer: bool = False) -> None:
    known = {r.key: r for r in ROWS if r.pp == 1}
    if key not in known:
        sys.exit(f"unknown one-stage row {key!r}; they are: {', '.join(sorted(known))}")
    row = known[key]
    priced: dict[str, tuple[str, str, float]] = {}
    price = sharding_plan.op_compute_seconds

    def recorded(graph, mesh, node, strategy):    # the last plan's price of each op
        seconds = price(graph, mesh, node, strategy)
        op = f"{node.op} <- {producer(graph, node) or 'leaf'}" if by_producer else node.op
        priced[node.name] = (op, node.phase, seconds)
        return seconds

    sharding_plan.op_compute_seconds = recorded
    plan = P.pinned_plan(row)
    e = plan.estimates
    print(f"{key}: step {e.step_time_s:.3f} s (published {row.published_step_s():.3f}); "
          f"compute {e.compute_s:.3f} comm {e.communication_s:.3f} hidden "
          f"{e.hidden_communication_s:.3f}; once per step {e.once_per_step_s:.3f}")
    k = row.global_batch // (row.micro_batch * row.dp)
    seconds, count = collections.Counter(), collections.Counter()
    for op, phase, t in priced.values():
        seconds[(op, phase)] += k * t
        count[(op, phase)] += 1
    print(f"ops' compute, summed: {sum(seconds.values()):.3f} s")
    for (op, phase), t in seconds.most_common(40 if by_producer else 30):
        print(f"    {op:<45} {phase:<9} {count[op, phase]:>5} x {t * 1e3:9.2f} ms")
    calls, size = collections.Counter(), collections.Counter()
    for c in plan.collectives:
        calls[(c.kind, c.phase, c.axis)] += 1
        size[(c.kind, c.phase, c.axis)] += c.bytes
    for kind, phase, axis in sorted(calls):
        print(f"    {kind:<15} {phase:<9} axis {axis}: {calls[kind, phase, axis]:>5} x, "
              f"{size[kind, phase, axis] / 2 ** 20:10.1f} MiB")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--by-producer"]
    if len(args) != 1:
        sys.exit(__doc__.splitlines()[2].strip())
    main(args[0], by_producer="--by-producer" in sys.argv[1:])
