"""One GPT-39B pipeline stage solved three ways: what each re-solve of the stage ILP buys.

    cd benchmarks && python stage_resolve.py [--layers 4 7] [--submesh 2 8] [--view 2 8]
                                             [--in-flight 3]

The stage (layers ``--layers`` of pipeline_vs_3d.py's 16 clustered GPT-39B layers on a
submesh of 8 x 8 H100s, ``--in-flight`` micro-batches of 8 x 128 in flight) is planned by
the intra-op ILP

- simplified: repeated layers share decisions, followers take their operand's layout;
- followers freed: the followers deciding on their own, layers still shared
  (``AutoShardingOption.free_followers_below``; solved in place of the simplified ILP);
- unsimplified: solved again from the simplified plan with nothing shared
  (``exact_below``; its HiGHS run stops at the 60 s ``time_limit``),

printing each one's estimated stage time and wall seconds.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import AutoLayerOption, PipeshardParallel
from torchalpa.frontends.torch_export import capture
from torchalpa.passes.pipeline_search import inter_op
from torchalpa.passes.pipeline_search.subgraph import stage_subgraph
from torchalpa.passes.sharding.intra_op import plan_intra_op

WAYS = {"simplified": dict(exact_below=0, free_followers_below=0),
        "followers freed": dict(exact_below=0),
        "unsimplified": dict(free_followers_below=0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs=2, default=(4, 7), metavar=("FIRST", "LAST"))
    p.add_argument("--submesh", type=int, nargs=2, default=(2, 8))
    p.add_argument("--view", type=int, nargs="+", default=(2, 8))
    p.add_argument("--in-flight", type=int, default=3)
    args = p.parse_args()
    cluster = torchalpa.Cluster.h100(num_nodes=8)
    workload = zoo.gpt_39b().replace(batch_size=8)
    with torch.device("meta"):
        model, batch = workload.build(), workload.example_inputs()
    graph = capture(model, batch, workload.loss_fn).graph
    method = PipeshardParallel(num_micro_batches=128, layer_option=AutoLayerOption(layer_num=16))
    layer = inter_op.assign_layers(graph, method, cluster.num_devices)
    first, last = args.layers
    stage = stage_subgraph(graph, {n: (0 if first <= l <= last else 1)
                                   for n, l in layer.items()}, 0).graph
    n, m = args.submesh
    mesh = replace(cluster, num_nodes=n, devices_per_node=m).logical_mesh(tuple(args.view))
    print(f"GPT-39B layers {first}-{last} ({len(stage)} nodes) on {tuple(args.submesh)} as "
          f"{tuple(args.view)}, {args.in_flight} micro-batches in flight")
    for name, knobs in WAYS.items():
        option = torchalpa.AutoShardingOption(solver="highs", **knobs)
        start = time.perf_counter()
        plan = plan_intra_op(stage, mesh, method.intra_op_method(option),
                             in_flight=args.in_flight,
                             blocks=stage.meta.get("repeated_blocks") or None)
        print(f"  {name:16s} stage {plan.estimates['step_time_s']:.6f} s, "
              f"planned in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
