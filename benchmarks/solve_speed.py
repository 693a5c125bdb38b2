"""How fast the intra-op planner solves big models (the graph already captured).

    python benchmarks/solve_speed.py [--models llama3_8b:16 gpt_39b:16 gpt_39b:32]
                                     [--mesh 8x8] [--solvers cbc highs]

End to end after capture: strategies, follower/layer grouping, cost graph, ILP build and
solve (with memory rounds), plan assembly. Targets on this 2-core machine: LLaMA-3-8B on
an 8x8 mesh of H100s in at most 10 s, GPT-39B in at most 20 s. No plan cache is used.
"""

import argparse
import resource
import time

import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel.shard import blocks_of
from torchalpa.passes.sharding.intra_op import plan_intra_op

TARGET_S = {"llama3_8b": 10.0, "gpt_39b": 20.0}
# LLaMA-3-8B as the issue states (batch 16 x 8192). GPT-39B's global batch of 1024 cannot
# fit a single intra-op step on 64 GPUs; it is planned at micro-batch sizes: 16 fits
# comfortably; from 32 on the 80 GB budget binds (memory-constraint rounds), 64 is the
# largest that fits on an 8x8 mesh.
DEFAULT_MODELS = ["llama3_8b:16", "gpt_39b:16", "gpt_39b:32", "gpt_39b:48", "gpt_39b:64"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                   help="preset names of torchalpa.models, optionally :batch")
    p.add_argument("--mesh", default="8x8")
    p.add_argument("--solvers", nargs="+", default=["cbc", "highs"])
    args = p.parse_args()
    shape = tuple(int(s) for s in args.mesh.split("x"))
    cluster = torchalpa.Cluster.h100(num_nodes=max(1, shape[0] * shape[-1] // 8))
    mesh = cluster.logical_mesh(shape)
    print(f"mesh {shape} of H100s ({cluster.num_nodes} nodes x 8)")
    print(f"{'model':<11}{'batch':>6}{'ops':>7}{'capture s':>10}{'solver':>7}{'plan s':>8}"
          f"{'target':>8}"
          f"{'decisions':>10}{'ILP vars':>9}{'step ms':>9}{'mem/dev GB':>11}")
    for spec in args.models:
        name, _, batch_size = spec.partition(":")
        workload = getattr(zoo, name)()
        if batch_size:
            workload = workload.replace(batch_size=int(batch_size))
        with torch.device("meta"):
            model, batch = workload.build(), workload.example_inputs()
        start = time.perf_counter()
        graph = capture(model, batch, workload.loss_fn).graph
        captured = time.perf_counter() - start
        for solver in args.solvers:
            method = torchalpa.ShardParallel(
                auto_sharding_option=torchalpa.AutoShardingOption(solver=solver))
            start = time.perf_counter()
            plan = plan_intra_op(graph, mesh, method, blocks=blocks_of(graph))
            seconds = time.perf_counter() - start
            e = plan.estimates
            print(f"{name:<11}{workload.batch_size:>6}{len(graph):>7}{captured:>10.1f}"
                  f"{solver:>7}{seconds:>8.2f}"
                  f"{TARGET_S.get(name, float('nan')):>8.0f}{e['num_decisions']:>10}"
                  f"{e['ilp_variables']:>9}{e['step_time_s'] * 1e3:>9.1f}"
                  f"{e['memory_per_device_bytes'] / 1e9:>11.1f}", flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {rss:.2f} GB")


if __name__ == "__main__":
    main()
