"""The automatic pipeline search against every hand-set 3D (dp, tp, pp) grid.

    python benchmarks/pipeline_vs_3d.py [--nodes 8] [--micro-batch 8] [--layers 16]
                                        [--solver cbc]

GPT-39B-shaped (48 layers, hidden 8192, 64 heads, seq 1024, global batch 1024) on nodes of
8 H100s, as in Alpa's GPT benchmark. Times the complete automatic search (layer clustering,
stage/submesh DP, intra-op plan of every stage) from the captured graph, then prices every
hand-set grid under the same cost model:
  - pp stages of equal layer counts (uniform split of the clustered layers),
  - each stage on 64/pp devices viewed as (dp, tp): Megatron tensor parallelism over tp
    within a node, the micro-batch split over dp (so dp must divide the micro-batch),
  - everything else completed by the same ILP, as an expert would tune it; when that
    does not fit in 80 GB with the micro-batches in flight, parameters, gradients and
    optimizer states are also sharded over dp (ZeRO / Megatron's distributed optimizer).
Prints each grid's estimated step time and throughput, and auto's ratio to the best one.
Targets (issue 6): search at most 60 s on this 2-core machine; auto's throughput at least
the best grid's.
"""

import argparse
import logging
import time
from dataclasses import replace

import torch
from expert_plans import megatron_pins

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import AutoLayerOption, ManualStageOption, PipeshardParallel
from torchalpa.frontends.torch_export import capture
from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
from torchalpa.passes.sharding.ilp import InfeasibleError

GLOBAL_BATCH = 1024


def grids(devices: int, per_node: int, micro_batch: int, layers: int):
    """(pp, dp, tp) points an expert would try: tp within a node, dp dividing the batch."""
    pp = 1
    while pp <= min(layers, devices):
        per_stage = devices // pp
        tp = 1
        while tp <= min(per_node, per_stage):
            dp = per_stage // tp
            if dp * tp == per_stage and micro_batch % dp == 0:
                yield pp, dp, tp
            tp *= 2
        pp *= 2


def grid_method(pp: int, dp: int, tp: int, layers: int, per_node: int, base: PipeshardParallel,
                option: torchalpa.AutoShardingOption, zero: bool) -> PipeshardParallel:
    """The grid point as manual stages; ``zero`` also shards parameters, gradients and
    optimizer states over dp (Megatron's distributed optimizer / ZeRO)."""
    per_stage = dp * tp
    other = "*" if zero else "R"
    submesh = (per_stage // per_node, per_node) if per_stage >= per_node else (1, per_stage)
    if tp == 1:
        logical, stage_option = (dp,), torchalpa.AutoShardingOption(
            solver=option.solver, force_batch_dim_to_mesh_dim=0)
    elif dp == 1:
        logical, stage_option = (tp,), torchalpa.AutoShardingOption(
            solver=option.solver, pin=megatron_pins(0, 1))
    else:
        logical, stage_option = (dp, tp), torchalpa.AutoShardingOption(
            solver=option.solver, force_batch_dim_to_mesh_dim=0, pin=megatron_pins(1, 2, other))
    if zero:
        stage_option = replace(stage_option, parameters="sharded")
    bounds = [round(s * layers / pp) for s in range(pp + 1)]
    return PipeshardParallel(
        num_micro_batches=base.num_micro_batches, layer_option=base.layer_option,
        pipeline_schedule=base.pipeline_schedule,
        stage_option=ManualStageOption(
            forward_stage_layer_ids=[list(range(bounds[s], bounds[s + 1])) for s in range(pp)],
            submesh_shapes=[submesh] * pp, logical_shapes=[logical] * pp,
            options=[stage_option] * pp))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=16, help="layers the search clusters into")
    p.add_argument("--solver", default="cbc")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args()
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    cluster = torchalpa.Cluster.h100(num_nodes=args.nodes)
    # the automatic search also chooses activation checkpointing per stage (the grids
    # keep their activations)
    option = torchalpa.AutoShardingOption(solver=args.solver, remat="auto")
    B = GLOBAL_BATCH // args.micro_batch
    workload = zoo.gpt_39b().replace(batch_size=args.micro_batch)
    with torch.device("meta"):
        model, batch = workload.build(), workload.example_inputs()
    start = time.perf_counter()
    graph = capture(model, batch, workload.loss_fn).graph
    print(f"GPT-39B, micro-batch {args.micro_batch} x {B}, {cluster.num_nodes} nodes x "
          f"{cluster.devices_per_node} H100; captured {len(graph)} ops in "
          f"{time.perf_counter() - start:.0f}s; solver {args.solver}", flush=True)

    base = PipeshardParallel(num_micro_batches=B, layer_option=AutoLayerOption(
        layer_num=args.layers), auto_sharding_option=option)
    start = time.perf_counter()
    auto = plan_pipeline(graph, cluster, base)
    searched = time.perf_counter() - start
    auto_step = _step(auto, cluster)
    print(f"auto: search {searched:.1f}s (target 60s); stages "
          f"{auto.forward_stage_layer_ids}, submeshes {auto.submesh_shapes}, logical "
          f"{auto.logical_shapes}, options {auto.stage_options}, recomputed "
          f"{[s.recompute for s in auto.stages]}; est step {_ms(auto_step)} ms, "
          f"{_throughput(auto_step)} samples/s", flush=True)

    print(f"{'pp':>3}{'dp':>4}{'tp':>4}{'ZeRO':>6}{'step ms':>10}{'samples/s':>11}{'mem GB':>8}"
          f"{'plan s':>8}")
    best = (float("inf"), None)
    for pp, dp, tp in grids(cluster.num_devices, cluster.devices_per_node, args.micro_batch,
                            args.layers):
        start = time.perf_counter()
        step, memory, zero = float("inf"), float("nan"), False
        for zero in (False, True):    # as an expert would: ZeRO over dp only if needed
            try:
                plan = plan_pipeline(graph, cluster, grid_method(
                    pp, dp, tp, args.layers, cluster.devices_per_node, base, option, zero))
            except InfeasibleError:
                continue
            step, memory = _step(plan, cluster), plan.estimates["memory_per_device_bytes"]
            if step < float("inf"):
                break
        if step < best[0]:
            best = (step, (pp, dp, tp))
        print(f"{pp:>3}{dp:>4}{tp:>4}{'yes' if zero else 'no':>6}{_ms(step):>10}"
              f"{_throughput(step):>11}{memory / 1e9:>8.1f}"
              f"{time.perf_counter() - start:>8.1f}", flush=True)
    if best[1] is None:
        print("no hand-set grid fits in memory")
        return
    pp, dp, tp = best[1]
    print(f"best hand grid pp{pp} dp{dp} tp{tp}: {_ms(best[0])} ms; auto {_ms(auto_step)} ms; "
          f"auto throughput / best grid's = {best[0] / auto_step:.3f} (>= 1.0 means at least "
          f"as good)")


def _step(plan, cluster) -> float:
    """Estimated step time, or inf when some stage does not fit in device memory."""
    if plan.estimates["memory_per_device_bytes"] > cluster.memory_per_device:
        return float("inf")
    return plan.estimates["step_time_s"]


def _ms(seconds: float) -> str:
    return "OOM" if seconds == float("inf") else f"{seconds * 1e3:.0f}"


def _throughput(seconds: float) -> str:
    return "-" if seconds == float("inf") else f"{GLOBAL_BATCH / seconds:.1f}"


if __name__ == "__main__":
    main()
