"""A view's re-solve at the solver's own gap, cold (main before r14-apath) and from the plan
found within the search's tolerance (``passes/sharding/plan_start.py``), alternately:

    OMP_NUM_THREADS=1 python benchmarks/polish_start_ab.py [--layers 32] [--views 2x4 4x2]
        [--candidates none:4 full:1:4] [--rounds 2]

Target a's model (LLaMA-3-8B bf16, batch 16 x 8192, 1 x 8 H100). For each candidate
(``remat:micro-batches``, ``:rg`` for parameters gathered again) and view, what AutoParallel's
search does there (``parallel/auto.py``: ``solve``, then ``polish``): the view's ILP within
the tolerance (gap 1 %), then the same ILP at the solver's own gap, cold and from the first
plan, ``--rounds`` times each in turn in this process (the captures and pricing memos warm
for both). Prints each re-solve's CPU seconds (``time.process_time``), HiGHS runs and
their CPU seconds, the ILP objective, the step estimate and a hash of the plan JSON (notes
and timings left out), then per view the CPU ratio from-plan/cold.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

os.environ["TORCHALPA_CACHE"] = "0"

from _planning import HIGHS, count_highs, target_a  # noqa: E402
from in_tree import plan_text  # noqa: E402

from torchalpa.core.options import AutoShardingOption, ShardParallel  # noqa: E402
from torchalpa.parallel.auto import derived_capture  # noqa: E402
from torchalpa.parallel.shard import blocks_of  # noqa: E402
from torchalpa.parallel.workflow import capture_examples, capture_step, with_precision  # noqa: E402
from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo  # noqa: E402
from torchalpa.passes.sharding import intra_op  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--views", nargs="+", default=["2x4", "4x2"])
    p.add_argument("--candidates", nargs="+", default=["none:4", "full:1:4"])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    count_highs()
    w, model, batch, cluster, precision = target_a(args.layers)
    model = with_precision(model, precision)
    plain: dict[int, object] = {}
    ratios = []
    for spec in args.candidates:
        remat, k, *rest = spec.split(":")
        regather = rest == ["rg"]
        if int(k) not in plain:
            plain[int(k)] = capture_step(model, capture_examples(model, batch, int(k)),
                                         w.loss_fn)
        graph = derived_capture(plain[int(k)], remat, regather).graph   # type: ignore[arg-type]
        memo, blocks = PricingMemo(), blocks_of(graph)

        def method(gap, k=int(k), regather=regather):
            return ShardParallel(num_micro_batches=k, auto_sharding_option=AutoShardingOption(
                gap=gap, rematerialize_parameters=regather))

        for view in args.views:
            mesh = cluster.logical_mesh(tuple(int(x) for x in view.split("x")))
            sharing: dict = {}
            HIGHS.clear()
            cpu = time.process_time()
            within = intra_op.plan_intra_op(graph, mesh, method(0.01), blocks=blocks,
                                            memo=memo, sharing=sharing)
            print(f"{spec} {view}: within 1 %: {time.process_time() - cpu:.1f} s CPU, HiGHS "
                  f"{len(HIGHS)} runs {sum(HIGHS):.1f} s, est {within.estimates.step_time_s!r}",
                  flush=True)
            seen: dict[str, list[float]] = {"cold": [], "from plan": []}
            for _ in range(args.rounds):
                for name, start in (("cold", None), ("from plan", within)):
                    HIGHS.clear()
                    cpu = time.process_time()
                    plan = intra_op.plan_intra_op(graph, mesh, method(None), blocks=blocks,
                                                  memo=memo, sharing=dict(sharing),
                                                  start_from=start)
                    cpu = time.process_time() - cpu
                    seen[name].append(cpu)
                    digest = hashlib.sha256(plan_text(plan).encode()).hexdigest()[:16]
                    print(f"  {name:9s}: {cpu:6.1f} s CPU | HiGHS {len(HIGHS)} runs "
                          f"{sum(HIGHS):6.1f} s | objective {plan.estimates.objective!r} | est "
                          f"{plan.estimates.step_time_s!r} | plan {digest} | load "
                          f"{os.getloadavg()[0]:.1f}", flush=True)
            ratio = sum(seen["from plan"]) / sum(seen["cold"])
            ratios.append(ratio)
            print(f"  {spec} {view}: CPU from plan / cold {ratio:.2f}", flush=True)
    print(f"all views: mean CPU from plan / cold {sum(ratios) / len(ratios):.2f}")


if __name__ == "__main__":
    main()
