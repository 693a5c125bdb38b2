"""Where a pipelined published row's step goes, stage by stage.

    cd benchmarks && python published_stages.py megatron21-76b

Plans the row as ``published.py`` does (its plan pinned) and prints, per stage: its
estimate (the step of one micro-batch plus what it pays once per step), compute and
communication, memory, and the seconds of its reshards' collectives by kind and mesh axis
(a gradient's final reduction apart: it runs once per step), with the step's longest
collectives and the values they reshard (producer -> consumer), then the schedule's end
per stage and what crosses once per step. Minutes per row on the CPU VM.
"""

from __future__ import annotations

import collections
import sys

import published as P
from published_rows import ROWS

from torchalpa.core.plan import OUTPUT

GIB = 2 ** 30
LARGEST = 6
"""Collectives in the step listed per stage, the longest first, with what they reshard (a
parameter's forward gather among them is paid once a step; the others per micro-batch)."""


def main(key: str) -> None:
    from torchalpa.passes.pipeline_search.submesh_views import submesh_cluster
    from torchalpa.passes.pricing.cost import collective_cost
    known = {r.key: r for r in ROWS if r.pp > 1}
    if key not in known:
        sys.exit(f"unknown pipelined row {key!r}; the pipelined rows are: "
                 f"{', '.join(sorted(known))}")
    row = known[key]
    plan = P.pinned_plan(row)
    e = plan.estimates
    print(f"{key}: step {e.step_time_s:.3f} s (published {row.published_step_s():.3f}); "
          f"per micro-batch {', '.join(f'{s:.3f}' for s in e.stage_step_s)} s")
    for s in plan.stages:
        x = s.plan.estimates
        print(f"stage {s.index}: one micro-batch + once {x.step_time_s:.3f} s, of which once "
              f"{x.once_per_step_s:.3f}; compute {x.compute_s:.3f} comm "
              f"{x.communication_s:.3f}; memory {x.memory_per_device_bytes / GIB:.2f} GiB "
              f"(states {x.model_state_bytes_per_device / GIB:.2f}, activation peak "
              f"{x.activation_bytes_per_device / GIB:.2f}, saved per micro-batch "
              f"{x.saved_activation_bytes_per_device / GIB:.2f})")
        mesh = submesh_cluster(row.cluster(), s.submesh).logical_mesh(tuple(s.plan.mesh_shape))
        seconds = collections.Counter()
        largest = []        # the reshards' collectives in the step, parameters' gathers too
        for r in s.plan.reshards:
            where = "gradient, once" if r.consumer == OUTPUT and r.slot.kind == "grad" \
                else f"send {r.slot.name}" if r.consumer == OUTPUT and r.slot.kind == "send" \
                else "in the step"
            for st in r.steps:
                if st.is_collective:
                    t = collective_cost(mesh, st.kind, st.axis, st.bytes)
                    seconds[(where, st.kind, st.axis)] += t
                    if where == "in the step":
                        largest.append((t, st.kind, st.axis, r))
        for (where, kind, axis), t in sorted(seconds.items()):
            print(f"    {where:<40} {kind:<15} axis {axis}: {t:.4f} s")
        for t, kind, axis, r in sorted(largest, key=lambda x: -x[0])[:LARGEST]:
            print(f"      {kind} axis {axis} {t:.4f} s: {r.producer} -> {r.consumer} "
                  f"(operand {r.slot})")
    print("schedule ends per stage:",
          ", ".join(f"{max(x for *_, x in st):.3f}" for st in e.timeline), "s")
    print("once per step between stages:", [(t.producer, t.src_stage, t.dst_stage, t.bytes)
                                             for t in plan.transfers if t.once_per_step])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.splitlines()[2].strip())
    main(sys.argv[1])
