"""Calibrates the host's seconds per op (``gpu_specs.HOST_OP_S``) from one-GPU logs.

    python benchmarks/host_per_op.py --against gpu_logs/h200-2026-11-28/bench.log \\
        gpu_logs/h200-2026-11-28/bench_fp32.log

Every zoo model and dtype of ``one_gpu.py`` is planned for one GPU of ``--cluster`` on the
meta device, as ``one_gpu.py --estimates-only`` does; the step walk's inputs of the chosen
plan (each op's kernel seconds, the optimizer's) are kept, and the step is re-walked with
the host issuing every op (views included) at ``h`` seconds each
(``passes/pricing/overlap_price.py``) for a range of ``h``. Printed per row: the captured
ops (of which views), measured ms (the torchalpa variant's step in the logs), measured ms
per op, the step without the host and est/meas at each ``h``; then the ``h`` that
minimizes the squared log of est/meas over all rows (one constant, every model and
dtype), and the rows' est/meas at it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import one_gpu  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.passes.pricing.overlap_price import Device  # noqa: E402
from torchalpa.passes.sharding import sharding_plan  # noqa: E402


def walk_inputs(model: str, dtype: str, cluster) -> dict:
    """Plan ``model`` in ``dtype`` for one GPU of ``cluster``; the chosen plan's step walk
    inputs (``sharding_plan._step_seconds``'s arguments) and its op counts."""
    calls = []
    original = sharding_plan._step_seconds

    def keep(graph, mesh, traffic, per_op, optimizer_s, device):
        result = original(graph, mesh, traffic, per_op, optimizer_s, device)
        calls.append((result[0], graph, mesh, traffic, list(per_op), optimizer_s))
        return result

    sharding_plan._step_seconds = keep
    try:
        step = one_gpu.estimate(model, dtype, cluster)["plan_step_s"]
    finally:
        sharding_plan._step_seconds = original
    chosen = [c for c in calls if math.isclose(c[0], step, rel_tol=1e-9)]
    if not chosen:
        raise RuntimeError(f"{model} {dtype}: no priced step equals the plan's {step}")
    _, graph, mesh, traffic, per_op, optimizer_s = chosen[-1]
    ops = list(graph.ops())
    return dict(graph=graph, mesh=mesh, traffic=traffic, per_op=per_op,
                optimizer_s=optimizer_s, ops=len(ops),
                views=sum(1 for n in ops if n.aliases))


def step_at(inputs: dict, h: float) -> float:
    """The step re-walked with ``h`` host seconds per op."""
    device = Device(host_s=(h,) * inputs["ops"] if h else (),
                    contention=inputs["mesh"].contention)
    return sharding_plan._step_seconds(inputs["graph"], inputs["mesh"], inputs["traffic"],
                                       inputs["per_op"], inputs["optimizer_s"], device)[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", nargs="+", required=True,
                   help="one_gpu.py logs with the torchalpa variant's measured steps")
    p.add_argument("--cluster", default="h200", help="preset planned for (default h200)")
    p.add_argument("--models", nargs="*", default=list(one_gpu.BENCHES),
                   choices=list(one_gpu.BENCHES))
    p.add_argument("--dtypes", nargs="*", default=["bf16", "fp32"], choices=list(one_gpu.DTYPES))
    args = p.parse_args()
    meas = one_gpu.measured_steps(args.against)
    cluster = torchalpa.Cluster.preset(args.cluster, 1, 1)
    if not cluster.host_op_s:      # keep the kernels' own times in the walk's inputs
        cluster = replace(cluster, host_op_s=1e-6)
    grid = [h * 1e-6 for h in range(0, 41)]
    rows = []
    for model in args.models:
        for dtype in args.dtypes:
            if (model, dtype) not in meas:
                print(f"  {model} {dtype}: not in the logs, skipped", flush=True)
                continue
            inputs = walk_inputs(model, dtype, cluster)
            rows.append((model, dtype, meas[(model, dtype)], inputs,
                         [step_at(inputs, h) for h in grid]))
            r = rows[-1]
            print(f"  {model:<10}{dtype:<6}{inputs['ops']:>6} ops ({inputs['views']} views)"
                  f"  measured {r[2] * 1e3:7.1f} ms ({r[2] / inputs['ops'] * 1e6:5.1f} us/op)"
                  f"  device alone {r[4][0] * 1e3:7.1f} ms", flush=True)
    errors = [sum(math.log(r[4][i] / r[2]) ** 2 for r in rows) for i in range(len(grid))]
    best = min(range(len(grid)), key=errors.__getitem__)
    print(f"\n{'h (us/op)':<15}" + "".join(f"{grid[i] * 1e6:>6.0f}" for i in range(0, len(grid), 4)))
    for model, dtype, m, _, steps in rows:
        print(f"{model + ' ' + dtype:<11}" + "".join(f"{steps[i] / m:6.2f}"
                                                     for i in range(0, len(grid), 4)))
    print(f"\nleast squares of log(est/meas) over {len(rows)} rows: h = {grid[best] * 1e6:.0f} us "
          f"per op (sum of squares {errors[best]:.3f}; {errors[0]:.3f} without the host)")
    for model, dtype, m, _, steps in rows:
        print(f"  {model:<10}{dtype:<6} est/meas {steps[0] / m:5.2f} -> {steps[best] / m:5.2f}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
