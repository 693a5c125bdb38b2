"""One pipeline candidate of target g, planned by two or more source trees in turn: CPU
seconds (the planning process and its forked workers) and the plan.

    git -C /work/main archive HEAD | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 python benchmarks/pipeline_cpu_ab.py /tmp/base . [--micro-batches 1024]
        [--rounds 1]

GPT-39B (batch 1024 x 1024, 8 x 8 H100) as AutoParallel's first candidate plans it
(``plan_pipeline`` with ``--micro-batches`` k, remat none, one micro-batch captured): the
layer phase, the stage DP with its exact stage solves, the uniform partitions and the
assembly. Each tree runs in its own process (``in_tree.py``), the trees alternating, so
each sees the same load. CPU seconds are wall-clock-free: this process's
(``time.process_time``) plus its finished workers' (``RUSAGE_CHILDREN``), capture apart.
Prints per run the wall and CPU seconds, the estimate and a hash of the plan JSON (notes,
timings and source paths left out), then each tree's CPU against the first tree's and
whether every plan is the same. The solver's time limit (a safety net) may stop a run on a loaded
machine (the plan's notes say so; the hash may then differ).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

from in_tree import plan_text, target_g_candidate


def _one(root: str, k: int, save: str | None) -> dict:
    """Plan the candidate with the tree at ``root``; its figures (its plan's JSON written
    to ``save``, if given)."""
    os.environ["TORCHALPA_CACHE"] = "0"
    graph, cluster, method = target_g_candidate(root, k)
    import resource
    import time

    from torchalpa.passes.pipeline_search.inter_op import plan_pipeline

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, cpu = time.perf_counter(), time.process_time()
    plan = plan_pipeline(graph, cluster, method)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu += (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
    text = plan_text(plan, indent=1)
    if save:
        with open(save, "w") as f:
            f.write(text)
    return {"wall": wall, "cpu": cpu, "est": plan.estimates.step_time_s,
            "clock": any("time limit" in n for n in plan.notes),
            "plan": hashlib.sha256(text.encode()).hexdigest()[:16]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+", help="source trees (git archives, or '.')")
    p.add_argument("--micro-batches", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--save", metavar="DIR", help="write each run's plan JSON there")
    p.add_argument("--one", metavar="ROOT", help=argparse.SUPPRESS)
    p.add_argument("--to", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(_one(os.path.abspath(args.one), args.micro_batches, args.to)))
        return
    if args.save:
        os.makedirs(args.save, exist_ok=True)
    runs: dict[str, list[dict]] = {tree: [] for tree in args.trees}
    for n in range(args.rounds):
        for m, tree in enumerate(args.trees):
            save = ["--to", os.path.join(args.save, f"{n}-{m}.json")] if args.save else []
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--one", os.path.abspath(tree),
                 "--micro-batches", str(args.micro_batches), *save, *args.trees],
                capture_output=True, text=True, check=True)
            run = json.loads(out.stdout.strip().splitlines()[-1])
            runs[tree].append(run)
            print(f"{tree}: {run['wall']:7.1f} s wall, {run['cpu']:7.1f} s CPU | est "
                  f"{run['est']!r} s/step{' (time limit hit)' if run['clock'] else ''} | plan "
                  f"{run['plan']} | load {os.getloadavg()[0]:.1f}", flush=True)

    def cpu(tree):
        return sum(r["cpu"] for r in runs[tree]) / len(runs[tree])

    first = args.trees[0]
    for tree in args.trees[1:]:
        print(f"{tree}: CPU {cpu(tree) / cpu(first):.2f}x {first}'s")
    same = len({r["plan"] for rs in runs.values() for r in rs}) == 1
    print(f"plans {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
