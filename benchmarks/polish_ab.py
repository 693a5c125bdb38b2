"""Target b's first pipeline candidate at fewer decoder layers, planned by two source trees
in turn: CPU seconds, HiGHS runs, stage ILPs, the estimate and the plan.

    git -C /work/main archive HEAD | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 python benchmarks/polish_ab.py /tmp/base . [--blocks 4]
        [--micro-batches 200] [--rounds 1] [--small-gpt]

LLaMA-2-13B cut to ``--blocks`` decoder layers (batch 200 x 4096, one micro-batch of
200 / k captured on the meta device) on target b's cluster (50 x 4 devices of 32 GB,
``_clusters.v100_like``), planned by ``plan_pipeline`` with ``PipeshardParallel(
num_micro_batches=k)`` (remat none): AutoParallel's first candidate on b. Everything runs
in the planning process (``workers=1``), so its CPU seconds (``time.process_time``) are
the whole search's and every HiGHS run is counted (``ilp_highs.solve_with_highs``
wrapped). Each tree runs in its own process (``in_tree.py``), the trees alternating, so
both see the same load. Prints per run the CPU seconds, HiGHS runs and their seconds,
stage ILPs, the estimate and a hash of the plan JSON (``in_tree.plan_text``: notes and
timings left out); then each tree's CPU and HiGHS runs against the first tree's, and
whether the plans are the same. The plan's notes (what the polish did) are printed too.
``--small-gpt``: the tests' small GPT pipeline instead (``tests/search_models.py``: 4
layers, 8 micro-batches on ``small_cluster()``) with every uniform partition priced
(``stage_search.UNIFORM_MARGIN`` inf), a small case with a polished stage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

from _clusters import v100_like
from in_tree import import_tree, plan_text


def _one(root: str, blocks: int, k: int, small_gpt: bool = False) -> dict:
    """Plan the candidate with the tree at ``root`` (the small GPT's pipeline with
    ``small_gpt``); its figures."""
    os.environ["TORCHALPA_CACHE"] = "0"
    import_tree(root)
    import torch

    import torchalpa
    import torchalpa.models as zoo
    from torchalpa.core.options import PipeshardParallel
    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.pipeline_search.inter_op import plan_pipeline

    assert torchalpa.__file__.startswith(root), (torchalpa.__file__, root)
    if small_gpt:
        return _small_gpt(root)
    w = zoo.llama2_13b(batch_size=200 // k).replace(num_layers=blocks)
    with torch.device("meta"):
        model, batch = w.build(), w.example_inputs()
    graph = capture(model, batch, w.loss_fn).graph
    cluster = v100_like(torchalpa, 50)
    return _measured(lambda: plan_pipeline(graph, cluster, PipeshardParallel(num_micro_batches=k),
                                           workers=1))


def _small_gpt(root: str) -> dict:
    """The small GPT's pipeline, every uniform partition priced, planned by the tree at
    ``root`` (imported already); its figures, as ``_one``'s."""
    import math

    sys.path.insert(0, os.path.join(root, "tests"))
    from search_models import small_cluster, small_gpt_graph, small_pipeline

    from torchalpa.passes.pipeline_search import stage_search
    from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
    stage_search.UNIFORM_MARGIN = math.inf
    graph = small_gpt_graph(4)
    return _measured(lambda: plan_pipeline(graph, small_cluster(), small_pipeline(4), workers=1))


def _measured(plan_call) -> dict:
    """Run ``plan_call`` (a pipeline plan) counting its HiGHS runs and their CPU: its CPU,
    HiGHS runs and seconds, stage ILPs, estimate, stages, polish notes and plan hash."""
    import torchalpa.passes.sharding.ilp_highs as ilp_highs
    runs = [0, 0.0]
    solve = ilp_highs.solve_with_highs

    def counted(*a, **kw):
        start = time.process_time()
        try:
            return solve(*a, **kw)
        finally:
            runs[0] += 1
            runs[1] += time.process_time() - start

    ilp_highs.solve_with_highs = counted
    cpu = time.process_time()
    plan = plan_call()
    cpu = time.process_time() - cpu
    text = plan_text(plan)
    return {"cpu": cpu, "highs": runs[0], "highs_s": runs[1],
            "stage_ilps": plan.estimates.stage_solves, "est": plan.estimates.step_time_s,
            "stages": len(plan.stages), "notes": [n for n in plan.notes if "polish" in n],
            "plan": hashlib.sha256(text.encode()).hexdigest()[:16]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+", help="source trees (git archives, or '.')")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=200)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--small-gpt", action="store_true")
    p.add_argument("--one", metavar="ROOT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(_one(os.path.abspath(args.one), args.blocks, args.micro_batches,
                              args.small_gpt)))
        return
    runs: dict[str, list[dict]] = {tree: [] for tree in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--one", os.path.abspath(tree),
                 "--blocks", str(args.blocks), "--micro-batches", str(args.micro_batches),
                 *(["--small-gpt"] if args.small_gpt else []), *args.trees], capture_output=True, text=True, check=True)
            run = json.loads(out.stdout.strip().splitlines()[-1])
            runs[tree].append(run)
            print(f"{tree}: {run['cpu']:7.1f} s CPU | {run['highs']} HiGHS runs "
                  f"({run['highs_s']:.1f} s) | {run['stage_ilps']} stage ILPs | "
                  f"{run['stages']} stages, est {run['est']!r} s/step | plan {run['plan']} | "
                  f"load {os.getloadavg()[0]:.1f}" + "".join(
                      f"\n    {note}" for note in run["notes"]), flush=True)

    def mean(tree: str, key: str) -> float:
        return sum(r[key] for r in runs[tree]) / len(runs[tree])

    first = args.trees[0]
    for tree in args.trees[1:]:
        print(f"{tree}: CPU {mean(tree, 'cpu') / mean(first, 'cpu'):.2f}x {first}'s, HiGHS "
              f"runs {mean(tree, 'highs') / mean(first, 'highs'):.2f}x, est "
              f"{mean(tree, 'est') / mean(first, 'est'):.4f}x")
    same = len({r["plan"] for rs in runs.values() for r in rs}) == 1
    print(f"plans {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
