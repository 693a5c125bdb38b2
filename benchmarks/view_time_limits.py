"""Target a's winning view (LLaMA-3-8B bf16, batch 16 x 8192 in 4 micro-batches, remat none,
1 x 8 H100) solved by ``plan_intra_op`` under several per-solve time limits, in one process:
does the solver's clock change the plan?

    OMP_NUM_THREADS=1 TORCHALPA_CACHE=0 python benchmarks/view_time_limits.py \
        [--views 2x4 4x2] [--limits none 60 4 2] [--gap 0.01]

``--gap 0`` is the solver's own gap (AutoParallel's re-solve of the views that could win),
0.01 the search's tolerance (its first solves). A limit of a few seconds stands for 60 s on
a machine many times slower (a 2-core VM at load 37 runs a solve about 18x slower). Prints
per view and limit the estimate, the ILP's objective and size, CPU and wall seconds and a
hash of the plan JSON (``in_tree.plan_text``: time limits left out), and the clock's note
where the limit fired.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import time

os.environ.setdefault("TORCHALPA_CACHE", "0")

import torch  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402
from torchalpa.core.options import AutoShardingOption, ShardParallel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--views", nargs="+", default=["2x4"])
    p.add_argument("--limits", nargs="+", default=["none", "60"])
    p.add_argument("--gap", type=float, default=0.01)
    p.add_argument("--max-nodes", type=int, default=2000)
    p.add_argument("--regather", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("torchalpa.passes.sharding.intra_op").setLevel(logging.INFO)
    from in_tree import plan_text

    from torchalpa.parallel.auto import derived_capture
    from torchalpa.parallel.shard import blocks_of, candidate_meshes
    from torchalpa.parallel.workflow import capture_examples, capture_step, with_precision
    from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
    from torchalpa.passes.sharding.intra_op import plan_intra_op
    k = 4
    w = zoo.llama3_8b().replace(num_layers=args.layers)
    with torch.device("meta"):
        model = w.build()
    model = with_precision(model, torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    t = time.process_time()
    plain = capture_step(model, capture_examples(model, w.example_inputs(device="meta"), k),
                         w.loss_fn)
    graph = derived_capture(plain, "none", False).graph
    print(f"captured {len(graph)} nodes in {time.process_time() - t:.1f} s CPU", flush=True)
    blocks = blocks_of(graph)
    meshes = {"x".join(map(str, m.shape)): m
              for m in candidate_meshes(torchalpa.Cluster.h100(1, 8), ShardParallel())}
    for view in args.views:
        for limit in args.limits:
            tl = None if limit == "none" else float(limit)
            method = ShardParallel(num_micro_batches=k, auto_sharding_option=AutoShardingOption(
                gap=args.gap if args.gap > 0 else None, time_limit=tl, max_nodes=args.max_nodes,
                rematerialize_parameters=args.regather))
            c0, w0 = time.process_time(), time.perf_counter()
            plan = plan_intra_op(graph, meshes[view], method, blocks=blocks, memo=PricingMemo())
            c1, w1 = time.process_time(), time.perf_counter()
            text = plan_text(plan)
            clock = [n for n in plan.notes if "time limit" in n]
            e = plan.estimates
            print(f"view {view} limit {limit}: est {e.step_time_s:.5f} obj {e.objective:.6f} "
                  f"vars {e.ilp_variables} mem {e.memory_per_device_bytes/1e9:.2f} GB "
                  f"cpu {c1-c0:.1f} s wall {w1-w0:.1f} s load {os.getloadavg()[0]:.1f} "
                  f"hash {hashlib.sha256(text.encode()).hexdigest()[:16]} clock {clock}",
                  flush=True)


if __name__ == "__main__":
    main()
