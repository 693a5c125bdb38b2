"""A pipelined published row at other scales its source reports: the estimate at each, and
the step split into what grows with the micro-batches and what is paid once per step.

    cd benchmarks && python published_scales.py bigscience-tr1-13b-v100x256 32:784:32.0 64:1024:22.3066

Arguments: the row, then ``NODES:GLOBAL_BATCH:STEP_S`` per scale (the row's own scale
among them, or not): its tp, pp, micro-batch and machine kept, dp = the devices over tp x
pp. A pipeline's step is (micro-batches + pp - 1) slots of one micro-batch plus what runs
once (the gradients' reduction, the optimizer); two scales with different micro-batch
counts solve that line for the published steps and for the estimates alike, so a gap can
be told apart: the per-micro-batch slot (compute, the stages' sends) or the once-per-step
part (data-parallel reduction, optimizer). The fit is exact for two scales, least squares
for more.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import published
from published_rows import ROWS


def _scale(row, spec: str):
    nodes, batch, step = spec.split(":")
    devices = int(nodes) * row.devices_per_node
    dp = devices // (row.tp * row.pp)
    return dataclasses.replace(row, num_nodes=int(nodes), dp=dp, global_batch=int(batch),
                               step_s=float(step), tflops_per_gpu=None,
                               tokens_per_gpu_s=None)


def _fit(slots: list[int], steps: list[float]) -> tuple[float, float]:
    """(seconds per slot, seconds once) of steps = slots * t + c."""
    t, c = np.polyfit(np.array(slots, float), np.array(steps, float), 1)
    return float(t), float(c)


def main(key: str, specs: list[str]) -> None:
    row = next((r for r in ROWS if r.key == key), None)
    if row is None:
        sys.exit(f"unknown row {key!r}")
    slots, published_s, estimated_s = [], [], []
    for spec in specs:
        r = _scale(row, spec)
        micro = r.global_batch // (r.micro_batch * r.dp)
        e = published.estimate(r)
        slots.append(micro + r.pp - 1)
        published_s.append(r.published_step_s())
        estimated_s.append(e.step_s)
        stages = ", ".join(f"{s:.3f}" for s in e.stage_s)
        print(f"{r.num_nodes} nodes: dp{r.dp}, {micro} micro-batches of {r.micro_batch}: "
              f"published {r.published_step_s():.3f} s, estimate {e.step_s:.3f} s (est/pub "
              f"{e.step_s / r.published_step_s():.2f}); stages {stages} s")
    if len(set(slots)) >= 2:
        for what, steps in (("published", published_s), ("estimate", estimated_s)):
            t, c = _fit(slots, steps)
            print(f"{what:>9}: {t:.3f} s per micro-batch slot, {c:.3f} s once per step")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__.splitlines()[2].strip())
    main(sys.argv[1], sys.argv[2:])
