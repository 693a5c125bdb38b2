"""LLaMA-2-13B on 50 nodes x 4 devices of 32 GB, global batch 200, with activation
checkpointing: does the pipeline search find a plan that fits, and how long does it take?

    python benchmarks/llama13b_remat.py [--remat full|auto|none] [--micro-batches 25]
                                        [--layers 10] [--nodes 50] [--solver highs]

The simulation of the project's origin (issue 15): seq 4096, 32 GB per device, links with
alpha (1, 1) and beta (1, 0.01) as there: equal latencies, the link within a node 100x
the bandwidth of the one between nodes (100 GB/s and 1 GB/s here; V100-like compute).
Without checkpointing no logical view fits (activations of a 4096-token micro-batch of
a 40-layer model); with it each block keeps only its input. Prints the search time (this
machine is shared: loaded-machine figures), the stages, the estimated step and memory.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import time

import torch
from _clusters import v100_like

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import AutoLayerOption, AutoShardingOption, PipeshardParallel
from torchalpa.core.plan import PipelinePlan

GB = 1024 ** 3
GLOBAL_BATCH = 200


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--remat", default="full", choices=("none", "full", "auto"))
    parser.add_argument("--micro-batches", type=int, default=25)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--solver", default="highs", choices=("highs", "cbc"),
                        help="ILP solver (highs: the model is passed to HiGHS as arrays)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    workload = zoo.llama2_13b(batch_size=GLOBAL_BATCH)
    with torch.device("meta"):
        model = workload.build()
    batch = workload.example_inputs(device="meta")
    method = PipeshardParallel(num_micro_batches=args.micro_batches,
                               layer_option=AutoLayerOption(layer_num=args.layers),
                               auto_sharding_option=AutoShardingOption(remat=args.remat,
                                                                       solver=args.solver))
    start = time.perf_counter()
    cpu_start = _cpu_seconds()
    try:
        plan = torchalpa.plan(model, batch, workload.loss_fn, method=method,
                              cluster=v100_like(torchalpa, args.nodes))
    except Exception as e:   # report, don't hide: the point is whether a plan exists
        print(f"no plan after {time.perf_counter() - start:.1f} s: {type(e).__name__}: {e}")
        return 1
    seconds = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu_start
    assert isinstance(plan, PipelinePlan), "PipeshardParallel plans a pipeline"
    est = plan.estimates
    print(f"LLaMA-2-13B, {args.nodes}x4 devices of 32 GB, batch {GLOBAL_BATCH} in "
          f"{args.micro_batches} micro-batches, remat={args.remat} -> "
          f"{plan.method.get('remat')}: plan in {seconds:.1f} s wall (capture included; "
          f"pipeline search {(est.search_seconds or 0):.1f} s), {cpu:.1f} s CPU "
          f"(this process and its workers), load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    print(f"  {(est.layer_solves or 0)} layer solves, {(est.layers_repriced or 0)} views "
          f"priced with their class's plan, {(est.stage_solves or 0)} stage solves")
    print(f"  {len(plan.stages)} stages, est step {(est.step_time_s or 0):.2f} s, memory "
          f"per device {(est.memory_per_device_bytes or 0) / GB:.1f} GiB (budget 32)")
    memory = est.stage_memory_bytes or []
    options = plan.stage_options
    for n, stage in enumerate(plan.stages):
        lean = " sharded states" if n < len(options) and options[n] else ""
        print(f"    stage {n}: layers {stage.layers[0]}-{stage.layers[-1]} on submesh "
              f"{stage.submesh} viewed as {stage.plan.mesh_shape}{lean}, "
              f"{stage.plan.estimates.step_time_s:.2f} s per micro-batch, "
              f"{memory[n] / GB if n < len(memory) else 0:.1f} GiB")
    for note in plan.notes:
        print("  note:", note)
    return 0


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (the solve workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if __name__ == "__main__":
    raise SystemExit(main())
