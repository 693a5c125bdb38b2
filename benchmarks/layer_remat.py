"""Checkpointing some blocks against checkpointing none or all, at memory budgets between.

    python benchmarks/layer_remat.py                          # LLaMA-3-8B, 1 x 8 H100
    python benchmarks/layer_remat.py --budgets 70 60 50 --micro-batches 4

LLaMA-3-8B (batch 16 x 8192, bf16 mixed precision, AdamW) on one node of 8 H100s, intra-op
plans with a fixed micro-batch count, planned without processes on meta weights. For each
memory budget per device (GB), prints the estimated step of the best plan that keeps every
block's activations (remat "none"), of the best that checkpoints every block ("full"), and
of what AutoParallel chooses when it may also checkpoint the first k of the 32 blocks
(``passes/sharding/layer_remat.py``), with k. "OOM": no plan of that kind fits. The captures are
made once and shared by every budget (one ``SearchSession``).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.parallel.auto import AutoResolver, Candidate, NothingFitsError, SearchSession
from torchalpa.parallel.workflow import with_precision
from torchalpa.passes.sharding.ilp import InfeasibleError

GB = 1e9


def uniform(search: SearchSession, method, remat: str, k: int):
    """The best intra-op plan checkpointing every block ('full') or none, or None (OOM)."""
    try:
        return search.solve(Candidate("intra-op", remat, k, 0.0, 0.0), method).estimates
    except InfeasibleError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", type=float, nargs="+", default=[80, 70, 60, 50, 40])
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--time-budget", type=float, default=600,
                    help="AutoParallel's time_budget_s (raise it on a loaded machine)")
    args = ap.parse_args()
    with torch.device("meta"):
        workload = zoo.llama3_8b()
        model = workload.build()
    batch = workload.example_inputs(device="meta")
    cluster = torchalpa.Cluster.h100(1, 8)
    bf16 = torchalpa.MixedPrecision(param_dtype=torch.bfloat16)
    method = torchalpa.AutoParallel(remat=("none", "full", "layers"), pipeline=False,
                                    num_micro_batches=args.micro_batches,
                                    rematerialize_parameters=False, optimizer="adamw",
                                    time_budget_s=args.time_budget)
    target = AutoResolver().target(method, cluster=cluster, mesh=None, world=1, live=False)
    search = SearchSession(with_precision(model, bf16), batch, workload.loss_fn, method=method,
                           cluster=cluster, meshes=target.meshes, allow_pipeline=False)
    print(f"LLaMA-3-8B, batch 16 x 8192, bf16, AdamW, 1 x 8 H100, intra-op, "
          f"{args.micro_batches} micro-batches (load {os.getloadavg()[0]:.1f})")
    print("| budget/device | none | full | AutoParallel (chosen) | chosen/best uniform | s |")
    print("|---|---|---|---|---|---|")
    for budget in args.budgets:
        start = time.perf_counter()
        budgeted = replace(method, auto_sharding_option=replace(
            method.auto_sharding_option, memory_budget_per_device=budget * GB))
        rows = {m: uniform(search, budgeted, m, args.micro_batches) for m in ("none", "full")}
        try:
            chosen = search.run(budgeted)
            text = (f"{chosen.estimates.step_time_s:.4g} s "
                    f"(remat={chosen.method['remat']}, "
                    f"{chosen.estimates.memory_per_device_bytes / GB:.1f} GB)")
            best = min((e.step_time_s for e in rows.values() if e is not None),
                       default=None)
            ratio = f"{chosen.estimates.step_time_s / best:.3f}" if best else "-"
        except NothingFitsError:
            text, ratio = "OOM", "-"
        cells = [f"{e.step_time_s:.4g} s ({e.memory_per_device_bytes / GB:.1f} GB)"
                 if e is not None else "OOM" for e in rows.values()]
        print(f"| {budget:g} GB | {cells[0]} | {cells[1]} | {text} | {ratio} | "
              f"{time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
