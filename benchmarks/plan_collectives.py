"""What a one-stage published row's priced plan communicates, and which ops it splits.

    cd benchmarks && python plan_collectives.py megatron20-a100-8b

Plans the row as ``published.py`` does (its plan pinned; rows with ``pp == 1``) and
prints the estimate, the plan's collectives a step by kind and phase (count, GiB), and the
ops whose results it keeps whole on every device against those it splits (GiB of results
by op): whether tensor parallelism runs plain (norms whole on every rank) or by sequence.
Minutes per row on the CPU VM.
"""

from __future__ import annotations

import collections
import sys

import published as P
from published_rows import ROWS

from torchalpa.core.placement import is_shard

GIB = 2 ** 30


def main(key: str) -> None:
    known = {r.key: r for r in ROWS if r.pp == 1}
    if key not in known:
        sys.exit(f"unknown one-stage row {key!r}; they are: {', '.join(sorted(known))}")
    row = known[key]
    graph = P.pinned_step(row)
    plan = P.pinned_plan(row, graph)
    e = plan.estimates
    print(f"{key}: step {e.step_time_s:.3f} s (published {row.published_step_s():.3f}); "
          f"compute {e.compute_s:.3f} comm {e.communication_s:.3f} "
          f"hidden {e.hidden_communication_s:.3f}")
    count, size = collections.Counter(), collections.Counter()
    for c in plan.collectives:
        count[(c.kind, c.phase)] += 1
        size[(c.kind, c.phase)] += c.bytes
    for k in sorted(count):
        print(f"    {k[0]:<15} {k[1]:<9} {count[k]:>5} x, {size[k] / GIB:8.3f} GiB")
    chosen = {s.node: s for s in plan.strategies}
    split, whole = collections.Counter(), collections.Counter()
    for n in graph.ops():
        s = chosen.get(n.name)
        if s is not None and n.outputs:
            (split if any(is_shard(p) for p in s.outputs[0]) else whole)[n.op] += \
                n.outputs[0].nbytes
    for name, table in (("kept whole", whole), ("split", split)):
        print(f"results {name} (GiB):")
        for op, b in table.most_common(12):
            print(f"    {op:<45} {b / GIB:8.2f}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.splitlines()[2].strip())
    main(sys.argv[1])
