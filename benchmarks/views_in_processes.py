"""The views of one intra-op plan solved one after another, then at once in forked
processes (``plan_graph(workers=)``, what AutoParallel's intra-op candidates do): wall and
CPU time of each (the workers' CPU counted), and whether the plans are the same.

    OMP_NUM_THREADS=1 python benchmarks/views_in_processes.py [layers] [workers]

LLaMA-3-8B at ``layers`` layers (default 2), batch 8 x 2048, every view of 1 x 8 H100,
bf16 parameters; ``workers`` (default: the cores this process may use). Times are this
machine's, which may be shared: the load average is printed with them.
"""

import json
import os
import resource
import sys
import time

os.environ["TORCHALPA_CACHE"] = "0"
import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import ShardParallel
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel.shard import blocks_of, candidate_meshes, plan_graph
from torchalpa.passes.pipeline_search.stage_jobs import cpu_workers


def _cpu() -> float:
    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                     resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _decision(plan) -> dict:
    data = json.loads(plan.to_json())
    data.pop("notes", None)
    data["estimates"] = {k: v for k, v in data["estimates"].items() if "second" not in k}
    return data


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else cpu_workers()
    w = zoo.llama3_8b(batch_size=8, seq_len=2048).replace(num_layers=layers)
    with torch.device("meta"):
        model = w.build()
    graph = capture(model, w.example_inputs(device="meta"), w.loss_fn).graph
    method = ShardParallel()
    meshes = candidate_meshes(torchalpa.Cluster.h100(1, 8), method)
    plans = []
    for n in (1, workers):
        wall, cpu = time.perf_counter(), _cpu()
        plans.append(plan_graph(graph, method=method, meshes=meshes, blocks=blocks_of(graph),
                                bound_views=False, workers=n))
        print(f"workers {n}: wall {time.perf_counter() - wall:.1f} s, CPU {_cpu() - cpu:.1f} s "
              f"(load {os.getloadavg()[0]:.1f}), est {plans[-1].estimates.step_time_s!r} "
              f"mesh {plans[-1].mesh_shape}", flush=True)
    print("same plan:", _decision(plans[0]) == _decision(plans[1]))


if __name__ == "__main__":
    main()
