"""Target g's exact stage solves, before and after, each tree in its own process in turn:

    git -C /work/main archive HEAD | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 python benchmarks/stage_solve_ab.py /tmp/base [--rounds 1]
        [--micro-batches 1024] [--stages 0,1,8 2,3,7 14,15,1] [--view 2 4]

GPT-39B (batch 1024 x 1024, 16 layers, 8 x 8 H100) as AutoParallel's first candidate
plans it (``--micro-batches`` k, one micro-batch of 1024 / k captured): the stages its
first DP round prices exactly (``ExactStages._solve_stage``, layers FIRST..LAST with
IN_FLIGHT micro-batches in flight, on one node viewed as ``--view``), solved one after
another. The tree at ``base`` (imported in place of this one, ``in_tree.py``) and this
tree alternate, so both see the same load. Prints each run's CPU seconds for the solves
(``time.process_time``, capture apart), each stage's latency (repr) and a hash of the
stage plans (notes, timings and source paths left out), then the CPU ratio after/before
and whether every latency and plan is equal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

from in_tree import plan_text, target_g_candidate

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one(root: str, k: int, stages: list[tuple[int, int, int]], view: tuple[int, ...]) -> dict:
    """Solve ``stages`` with the tree at ``root``; its figures."""
    os.environ["TORCHALPA_CACHE"] = "0"
    graph, cluster, method = target_g_candidate(root, k)
    import time

    from torchalpa.passes.pipeline_search.exact_stages import ExactStages
    from torchalpa.passes.pipeline_search.layer_cache import SolveCache
    from torchalpa.passes.pipeline_search.layer_costs import LayerCosts
    from torchalpa.passes.pipeline_search.layers import assign_layers
    from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
    from torchalpa.passes.pipeline_search.search_problem import SearchProblem
    from torchalpa.passes.pipeline_search.stage_costs import StageCosts

    problem = SearchProblem(graph, assign_layers(graph, method, cluster.num_devices),
                            cluster, method, "global")
    layers = LayerCosts(problem, SolveCache(), PricingMemo(), None, True)
    exact = ExactStages(problem, StageCosts(problem, layers), SolveCache())
    cpu = time.process_time()
    latencies = [exact._solve_stage(first, last, (1, 8), view, flight, None)[0]
                 for first, last, flight in stages]
    cpu = time.process_time() - cpu
    text = "\n".join(plan_text(exact.exact_plans[key]) for key in sorted(
        exact.exact_plans, key=repr))
    return {"cpu": cpu, "latencies": latencies,
            "plan": hashlib.sha256(text.encode()).hexdigest()[:16]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", help="the tree before (a git archive of it)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=1024)
    p.add_argument("--stages", nargs="+", default=["0,1,8", "2,3,7", "14,15,1"],
                   help="FIRST,LAST,IN_FLIGHT of each stage")
    p.add_argument("--view", type=int, nargs="+", default=[2, 4])
    p.add_argument("--one", metavar="ROOT", help=argparse.SUPPRESS)
    args = p.parse_args()
    stages = [tuple(int(x) for x in s.split(",")) for s in args.stages]
    if args.one:
        print(json.dumps(_one(os.path.abspath(args.one), args.micro_batches, stages,
                              tuple(args.view))))
        return
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for name, root in (("before", os.path.abspath(args.base)), ("after", HERE)):
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), args.base, "--one", root,
                 "--micro-batches", str(args.micro_batches), "--stages", *args.stages,
                 "--view", *map(str, args.view)], capture_output=True, text=True, check=True)
            run = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append(run)
            print(f"{name:6s}: {run['cpu']:6.1f} s CPU for {len(stages)} stage solves | "
                  f"latencies {run['latencies']} | plans {run['plan']} | load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)

    def mean(name):
        return sum(r["cpu"] for r in runs[name]) / len(runs[name])

    same = len({(tuple(r["latencies"]), r["plan"]) for rs in runs.values() for r in rs}) == 1
    print(f"CPU after/before {mean('after') / mean('before'):.2f}x; latencies and plans "
          f"{'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
