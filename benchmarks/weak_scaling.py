"""Alpa's GPT weak-scaling suite in simulation: the automatic plan against every hand grid.

    python benchmarks/weak_scaling.py [--rows 350m 1.3b] [--micro-batches 16 64]
                                      [--max-pp 8] [--remat none full] [--layers 8]

Each row is a GPT of Alpa's suite on its H100 cluster (350M on 1, 1.3B on 4, 2.6B on 8,
6.7B on 16, 15B on 32, 39B on 64 devices; seq 1024, global batch 1024), planned:
  - automatically: the pipeline search (layer clustering, stage/submesh DP, intra-op ILP
    of each stage) with ``remat`` chosen by the planner (both captures planned, the
    faster plan that fits kept), once per micro-batch count, the best one reported;
  - by hand: every (pp, dp, tp) grid of ``pipeline_vs_3d.grids`` (Megatron tp within a
    node, the micro-batch over dp, equal layer counts per stage, ZeRO over dp only if
    needed) for every micro-batch count and remat mode, priced by the same cost model.
A plan whose memory estimate exceeds 80 GB counts as OOM. Prints per row the estimated
step time, TFLOP/s per GPU (model flops, recomputation not counted), the best grid,
auto's step time over the best grid's (<= 1.00 means auto is at least as good; the issue
writes it as throughput auto/best >= 1.00x) and the seconds each search took.
``--micro-batches``, ``--max-pp`` and ``--remat`` shrink the grid to check a row quickly.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass

import torch
from pipeline_vs_3d import _step, grid_method, grids

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import AutoLayerOption, PipeshardParallel
from torchalpa.frontends.block_remat import checkpointed_capture
from torchalpa.frontends.torch_export import capture
from torchalpa.models import ALPA_GPT
from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
from torchalpa.passes.sharding.ilp import InfeasibleError
from torchalpa.passes.sharding.remat_choice import compute_lower_bound, plan_with_remat

GLOBAL_BATCH = 1024
SEQ = 1024
VOCAB = 51200


@dataclass(frozen=True)
class Row:
    """One row of Alpa's weak-scaling suite (Alpa's ``benchmark/alpa/suite_paper.py``)."""

    hidden: int
    layers: int
    heads: int
    devices: int


_DEVICES = {"350m": 1, "1.3b": 4, "2.6b": 8, "6.7b": 16, "15b": 32, "39b": 64}
ROWS = {size: Row(*ALPA_GPT[size], devices) for size, devices in _DEVICES.items()}
"""The sizes are the zoo's (``torchalpa.models.ALPA_GPT``); the devices Alpa ran each on."""


def model_flops(row: Row) -> float:
    """Flops of one training step without recomputation (Megatron's count: 72 B s l h^2
    (1 + s / 6h + V / 12 l h))."""
    h, l = row.hidden, row.layers
    return 72 * GLOBAL_BATCH * SEQ * l * h * h * (1 + SEQ / (6 * h) + VOCAB / (12 * l * h))


def captures(row: Row, micro_batch: int) -> dict:
    """remat mode -> the step captured for one micro-batch (checkpointed one derived)."""
    config = zoo.GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, num_layers=row.layers,
                           num_heads=row.heads, hidden=row.hidden, dropout=0.0)
    workload = zoo.Workload("gpt", config, micro_batch, SEQ)
    with torch.device("meta"):
        model, batch = workload.build(), workload.example_inputs()
    plain = capture(model, batch, workload.loss_fn)
    return {"none": plain, "full": checkpointed_capture(plain)}


def auto_step(variants: dict, cluster, base: PipeshardParallel) -> tuple[float, str]:
    """The automatic plan's step time (remat chosen by the planner) and a description."""
    try:
        plan = plan_with_remat(variants, lambda c: plan_pipeline(c.graph, cluster, base),
                               lambda c: c.graph, lambda c: compute_lower_bound(
                                   c.graph, cluster, base.num_micro_batches))
    except InfeasibleError:
        return float("inf"), "no plan"
    return _step(plan, cluster), (f"stages {[len(s) for s in plan.forward_stage_layer_ids]} "
                                  f"submeshes {plan.submesh_shapes} logical "
                                  f"{plan.logical_shapes} remat {plan.method['remat']}, "
                                  f"stages recomputed {[s.recompute for s in plan.stages]}")


def grid_step(graph, cluster, pp: int, dp: int, tp: int, layers: int,
              base: PipeshardParallel) -> float:
    """A hand grid's step time: without ZeRO, else with ZeRO over dp (as an expert would)."""
    option = torchalpa.AutoShardingOption(solver=base.auto_sharding_option.solver)
    for zero in (False, True):
        try:
            plan = plan_pipeline(graph, cluster, grid_method(
                pp, dp, tp, layers, cluster.devices_per_node, base, option, zero))
        except InfeasibleError:
            continue
        step = _step(plan, cluster)
        if step < float("inf"):
            return step
    return float("inf")


def run_row(name: str, args) -> None:
    row = ROWS[name]
    cluster = torchalpa.Cluster.h100(num_nodes=max(1, row.devices // 8),
                                     devices_per_node=min(8, row.devices))
    # the automatic search also chooses activation checkpointing per stage
    option = torchalpa.AutoShardingOption(solver=args.solver, remat="auto")
    auto_best, auto_text, auto_seconds = float("inf"), "no plan", 0.0
    grid_best, grid_text, grid_seconds, capture_seconds = float("inf"), "none fits", 0.0, 0.0
    for num_micro in args.micro_batches:
        if GLOBAL_BATCH % num_micro:
            raise ValueError(f"--micro-batches {num_micro} does not divide the global batch "
                             f"{GLOBAL_BATCH}")
        micro_batch = GLOBAL_BATCH // num_micro
        start = time.perf_counter()
        variants = captures(row, micro_batch)
        capture_seconds += time.perf_counter() - start
        base = PipeshardParallel(num_micro_batches=num_micro, auto_sharding_option=option,
                                 layer_option=AutoLayerOption(layer_num=args.layers))
        start = time.perf_counter()
        step, text = auto_step(variants, cluster, base)
        auto_seconds += time.perf_counter() - start
        if step < auto_best:
            auto_best, auto_text = step, f"{num_micro} micro-batches, {text}"
        start = time.perf_counter()
        for remat in args.remat:
            for pp, dp, tp in grids(row.devices, cluster.devices_per_node, micro_batch,
                                    args.layers):
                if pp > args.max_pp:
                    continue
                step = grid_step(variants[remat].graph, cluster, pp, dp, tp, args.layers, base)
                if args.verbose:
                    print(f"    grid pp{pp} dp{dp} tp{tp} B{num_micro} remat {remat}: "
                          f"{_ms(step)} ms", flush=True)
                if step < grid_best:
                    grid_best = step
                    grid_text = f"pp{pp} dp{dp} tp{tp} B{num_micro} remat {remat}"
        grid_seconds += time.perf_counter() - start
    ratio = "-" if grid_best == float("inf") or auto_best == float("inf") else \
        f"{auto_best / grid_best:.3f}"
    print(f"{name:>5} {row.devices:>3} | auto {_ms(auto_best):>8} ms {_tflops(row, auto_best):>6}"
          f" TFLOP/s | best grid {_ms(grid_best):>8} ms {_tflops(row, grid_best):>6} TFLOP/s "
          f"({grid_text}) | auto/grid step {ratio} | search {auto_seconds:.0f}s, grids "
          f"{grid_seconds:.0f}s, captures {capture_seconds:.0f}s", flush=True)
    print(f"        auto: {auto_text}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--micro-batches", nargs="+", type=int, default=[16, 64],
                   help="micro-batch counts tried (auto and grids alike)")
    p.add_argument("--remat", nargs="+", default=["none", "full"], choices=["none", "full"],
                   help="remat modes of the hand grids (auto always chooses between both)")
    p.add_argument("--max-pp", type=int, default=64, help="largest grid pipeline depth")
    p.add_argument("--layers", type=int, default=8, help="layers the search clusters into")
    p.add_argument("--solver", default="highs")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(f"GPT weak scaling, seq {SEQ}, global batch {GLOBAL_BATCH}, H100 nodes of 8 "
          f"(80 GB); micro-batch counts {args.micro_batches}, grid remat {args.remat}, "
          f"pp <= {args.max_pp}, {args.layers} layers; solver {args.solver}", flush=True)
    for name in args.rows:
        run_row(name, args)


def _ms(seconds: float) -> str:
    return "OOM" if seconds == float("inf") else f"{seconds * 1e3:.0f}"


def _tflops(row: Row, seconds: float) -> str:
    if seconds == float("inf"):
        return "-"
    return f"{model_flops(row) / seconds / row.devices / 1e12:.1f}"


if __name__ == "__main__":
    main()
