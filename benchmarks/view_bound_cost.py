"""What one view's LP bound and its ILP solve cost, and how close the bound is.

    OMP_NUM_THREADS=1 python benchmarks/view_bound_cost.py [--layers 32] [--views 2x4]
        [--remat none full] [--unsimplified]

LLaMA-3-8B (target a's model at ``--layers`` layers) bf16, batch 16 x 8192 in 4 micro-batches,
1 x 8 H100; for each checkpointing mode and view, with a fresh ``PricingMemo``: the problem
built (``intra_op_problem``), ``step_time_lower_bound`` with the graph's blocks (what
AutoParallel cuts views by, ``view_cuts.py``), then ``plan_intra_op`` (at the search's gap:
1% where memory is tight, remat none), and with ``--unsimplified`` the bound without blocks
(every node deciding on its own: the LP ``plan_graph`` used before). CPU seconds of this
process (the load moves them less than wall seconds), the bound over the estimate.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TORCHALPA_CACHE", "0")

import torch  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402
from torchalpa.core.options import AutoShardingOption, ShardParallel  # noqa: E402


def _cpu(fn):
    start = time.process_time()
    return fn(), time.process_time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--views", nargs="+", default=["2x4"])
    p.add_argument("--remat", nargs="+", default=["none", "full"])
    p.add_argument("--unsimplified", action="store_true")
    args = p.parse_args()
    from torchalpa.parallel.auto import derived_capture
    from torchalpa.parallel.shard import blocks_of, candidate_meshes
    from torchalpa.parallel.workflow import capture_examples, capture_step, with_precision
    from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
    from torchalpa.passes.sharding.intra_op import (
        intra_op_problem,
        plan_intra_op,
        step_time_lower_bound,
    )
    k = 4
    w = zoo.llama3_8b().replace(num_layers=args.layers)
    with torch.device("meta"):
        model = w.build()
    model = with_precision(model, torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    plain = capture_step(model, capture_examples(model, w.example_inputs(device="meta"), k),
                         w.loss_fn)
    meshes = {"x".join(map(str, m.shape)): m
              for m in candidate_meshes(torchalpa.Cluster.h100(1, 8), ShardParallel())}
    for remat in args.remat:
        graph = derived_capture(plain, remat, False).graph
        blocks = blocks_of(graph)
        method = ShardParallel(num_micro_batches=k, auto_sharding_option=AutoShardingOption(
            gap=0.01 if remat == "none" else None))
        for view in args.views:
            mesh, memo = meshes[view], PricingMemo()
            _, problem_s = _cpu(lambda: intra_op_problem(graph, mesh, method, "global", memo))
            bound, bound_s = _cpu(lambda: step_time_lower_bound(graph, mesh, method, memo=memo,
                                                                blocks=blocks))
            plan, solve_s = _cpu(lambda: plan_intra_op(graph, mesh, method, blocks=blocks,
                                                       memo=memo))
            est = plan.estimates
            line = (f"remat={remat} {view} ({len(graph)} nodes): est {est.step_time_s:.4f} s, "
                    f"solve {solve_s:.1f} s CPU (last ILP {est.ilp_seconds:.1f} s, "
                    f"{est.ilp_variables} vars) | problem {problem_s:.1f} s | LP with blocks "
                    f"{bound:.4f} ({bound / est.step_time_s:.3f}), {bound_s:.1f} s")
            if args.unsimplified:
                plain_bound, plain_s = _cpu(lambda: step_time_lower_bound(graph, mesh, method,
                                                                          memo=memo))
                line += (f" | unsimplified {plain_bound:.4f} "
                         f"({plain_bound / est.step_time_s:.3f}), {plain_s:.1f} s")
            print(line, flush=True)


if __name__ == "__main__":
    main()
