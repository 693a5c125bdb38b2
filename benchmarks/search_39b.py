"""pipeline_vs_3d.py's automatic search alone: GPT-39B on 8 x 8 H100, micro-batch 8 x 128,
16 layers, HiGHS, the worker pool as the search sizes it.

    cd benchmarks && python search_39b.py [--save-tables DIR]

Prints the search's wall and CPU seconds (workers included), the plan and its estimated
step, with the planner's log (each ILP's time). ``--save-tables``: every stage-DP cost
table as DIR/C_<n>.npy, for ``dp_tables.py`` to time the DP on.
"""

from __future__ import annotations

import argparse
import logging
import resource
import time

import numpy as np
import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import AutoLayerOption, PipeshardParallel
from torchalpa.frontends.torch_export import capture
from torchalpa.passes.pipeline_search import stages
from torchalpa.passes.pipeline_search.inter_op import plan_pipeline


def _cpu() -> float:
    """CPU seconds of this process and of its finished worker processes."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--save-tables", metavar="DIR")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(message)s")
    saved = []
    if args.save_tables:
        table = stages._cost_table

        def keep(*a):
            C = table(*a)
            np.save(f"{args.save_tables}/C_{len(saved)}.npy", C)
            saved.append(C)
            return C
        stages._cost_table = keep
    cluster = torchalpa.Cluster.h100(num_nodes=8)
    option = torchalpa.AutoShardingOption(solver="highs", remat="auto")
    workload = zoo.gpt_39b().replace(batch_size=8)
    with torch.device("meta"):
        model, batch = workload.build(), workload.example_inputs()
    graph = capture(model, batch, workload.loss_fn).graph
    base = PipeshardParallel(num_micro_batches=128, layer_option=AutoLayerOption(layer_num=16),
                             auto_sharding_option=option)
    wall, cpu = time.perf_counter(), _cpu()
    auto = plan_pipeline(graph, cluster, base)
    print(f"auto: search wall {time.perf_counter() - wall:.1f}s CPU {_cpu() - cpu:.1f}s; "
          f"stages {auto.forward_stage_layer_ids}, submeshes {auto.submesh_shapes}, logical "
          f"{auto.logical_shapes}, recomputed {[s.recompute for s in auto.stages]}; est step "
          f"{auto.estimates['step_time_s']:.6g} s; {len(saved)} DP tables saved", flush=True)


if __name__ == "__main__":
    main()
