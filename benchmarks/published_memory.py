"""What the memory model holds at a published row's activation peak and where forward ends,
by op: one data-parallel replica's micro-batch on one device (``dp = 1``), every value
whole, the row's step captured as ``published.py`` captures it.

    cd benchmarks && python published_memory.py mpt-760m-h100x8 [TOP]

For rows the planner refuses ("does not fit"): which values make the bound. The figures are
``passes/pricing/memory.py``'s own (every op result alive from the op that makes it to its
last reader, in the step's order); seconds to a minute per row on the CPU VM.
"""

from __future__ import annotations

import collections
import sys
from dataclasses import replace

import numpy as np
import published
from published_rows import ROWS

GiB = 2 ** 30


def main(key: str, top: int = 25) -> None:
    from torchalpa.core.placement import Replicate
    from torchalpa.passes.pricing.memory import (
        activation_timeline,
        forward_end,
        liveness,
        value_bytes,
    )
    known = {r.key: r for r in ROWS}
    if key not in known:
        sys.exit(f"unknown row {key!r}; the rows are: {', '.join(sorted(known))}")
    row = known[key]
    row = replace(row, dp=1, num_nodes=1, devices_per_node=1, tp=1, pp=1,
                  global_batch=row.micro_batch)
    graph = published.pinned_step(row)
    outputs = {n.name: tuple((Replicate(),) for _ in n.outputs) for n in graph}
    live = liveness(graph)
    timeline = activation_timeline(graph, live, outputs, (1,))
    peak, end = int(np.argmax(timeline)), forward_end(graph)
    order = [n.name for n in graph]
    at = graph.node(order[min(peak, len(order) - 1)])
    print(f"{key}, one replica's micro-batch on one device: activation peak "
          f"{timeline.max() / GiB:.2f} GiB at op {peak} ({at.phase} {at.op}); "
          f"{timeline[end] / GiB:.2f} GiB alive where forward ends (op {end})")
    for title, t in (("at the peak", peak), ("where forward ends", end)):
        by_op: collections.Counter = collections.Counter()
        for i in live.alive(t):
            name, k = live.names[i], live.results[i]
            n = graph.node(name)
            dtype = n.outputs[k or 0].dtype if n.outputs else ""
            label = n.op if k is None else f"{n.op}[{k}]"
            by_op[f"{label} {n.phase} {dtype}"] += value_bytes(graph, name, outputs[name],
                                                               (1,), result=k)
        print(f"\n{title}: {sum(by_op.values()) / GiB:.2f} GiB")
        for label, nbytes in by_op.most_common(top):
            print(f"  {label:<60}{nbytes / GiB:8.3f}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
