"""Planning's CPU seconds and plan JSON on target a's model, to compare two commits back to
back on a loaded machine (CPU seconds move less with the load than wall seconds do):

    git archive <commit> | tar -x -C /tmp/base        # then run the same command there,
    python benchmarks/planning_cpu_ab.py 16 /tmp/after.json   # with that tree imported
    diff <(sed 's|"base/|"|' /tmp/before.json) /tmp/after.json

LLaMA-3-8B at ``layers`` layers (default 16), bf16, batch 16 x 8192, 1 x 8 H100. Default:
one intra-op candidate like target a's first (4 micro-batches, every view in turn, the
big-graph path of ``plan_intra_op`` forced: ``exact_below=0, free_followers_below=0``).
``--search``: the whole AutoParallel search (target a's) with no time limit and no time
budget, views solved in this process (``--big``: the big-graph path forced, as above),
so the plan depends on the work bounds alone and every solver second is this process's
CPU time. Prints wall and CPU seconds of planning (capture apart), the estimate and a hash
of the plan JSON (notes, timings and source paths left out).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

os.environ["TORCHALPA_CACHE"] = "0"

import torch  # noqa: E402
from in_tree import plan_text  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402
from torchalpa.core.options import AutoParallel, AutoShardingOption, ShardParallel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("layers", type=int, nargs="?", default=16)
    p.add_argument("out", nargs="?", default="/tmp/planning_cpu_ab.json")
    p.add_argument("--search", action="store_true", help="the whole AutoParallel search")
    p.add_argument("--big", action="store_true",
                   help="with --search: the big-graph path forced (exact_below=0, "
                        "free_followers_below=0), so that a few layers take target a's path")
    args = p.parse_args()
    w = zoo.llama3_8b().replace(num_layers=args.layers)
    with torch.device("meta"):
        model = w.build()
    batch = w.example_inputs(device="meta")
    cluster = torchalpa.Cluster.h100(1, 8)
    bf16 = torchalpa.MixedPrecision(param_dtype=torch.bfloat16)
    capture_s = 0.0
    if args.search:
        from torchalpa.passes.pipeline_search import stage_jobs
        stage_jobs.cpu_workers = lambda: 1        # every solve in this process
        big = {"exact_below": 0, "free_followers_below": 0} if args.big else {}
        method = AutoParallel(time_budget_s=1e6,
                              auto_sharding_option=AutoShardingOption(time_limit=None, **big))
        wall, cpu = time.perf_counter(), time.process_time()
        plan = torchalpa.plan(model, batch, w.loss_fn, cluster=cluster, mixed_precision=bf16,
                              method=method)
    else:
        from torchalpa.parallel.shard import blocks_of, candidate_meshes, plan_graph
        from torchalpa.parallel.workflow import capture_examples, capture_step, with_precision
        k = 4
        start = time.perf_counter()
        model = with_precision(model, bf16)
        graph = capture_step(model, capture_examples(model, batch, k), w.loss_fn).graph
        capture_s = time.perf_counter() - start
        method = ShardParallel(num_micro_batches=k, auto_sharding_option=AutoShardingOption(
            exact_below=0, free_followers_below=0))
        wall, cpu = time.perf_counter(), time.process_time()
        plan = plan_graph(graph, method=method, meshes=candidate_meshes(cluster, method),
                          blocks=blocks_of(graph), bound_views=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    text = plan_text(plan, indent=1)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"planned in {wall:.1f} s wall, {cpu:.1f} s CPU (capture {capture_s:.1f} s apart; "
          f"load {os.getloadavg()[0]:.1f}) | est {plan.estimates.step_time_s!r} s/step, mesh "
          f"{'x'.join(map(str, plan.mesh_shape))} | plan {hashlib.sha256(text.encode()).hexdigest()[:16]}")
    for note in plan.notes:
        if note.startswith(("AutoParallel", "runner-up", "the solver")):
            print("   ", note)


if __name__ == "__main__":
    main()
