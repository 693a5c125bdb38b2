"""Target a planned by two trees in turn, in child processes: ratios from one run (named for
the view cuts it first compared, since removed; it compares any two trees).

    git -C <main> archive HEAD | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 python benchmarks/view_cuts_ab.py --base /tmp/base [--rounds 1]
        [--no-clock]

Plans target a of ``auto_targets.py`` (LLaMA-3-8B bf16, batch 16 x 8192, 1 x 8 H100,
AutoParallel with its defaults) in a child process importing ``--base`` (a pristine copy
of another commit; links for ``torchalpa/{passes,frontends,runtime}`` are made there, as
the editable install maps them), then in one importing this tree, ``--rounds`` times
alternately. Prints per run the wall seconds, the estimate, the chosen method and a hash of
the plan JSON (notes, timings and source paths left out: the same hash is the same plan)
and the search's notes; then new/old ratios of wall seconds and of CPU seconds (the
child's and its forked workers', which the load moves less). The machine may be shared:
compare ratios within one run, not absolute times.
``--no-clock`` lifts AutoParallel's safety net (``time_budget_s``, 600 s) in both: on a
loaded machine it may otherwise stop one tree's search and not the other's, and the two
would not have done the same work.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time

from in_tree import plan_text


def child() -> None:
    """Plan target a here and print one JSON line of what came of it."""
    os.environ["TORCHALPA_CACHE"] = "0"
    import torch

    import torchalpa
    import torchalpa.models as zoo
    workload = zoo.llama3_8b()
    with torch.device("meta"):
        model = workload.build()
    batch = workload.example_inputs(device="meta")
    bf16 = torchalpa.MixedPrecision(param_dtype=torch.bfloat16)
    start = time.perf_counter()
    budget = float(os.environ.get("VIEW_CUTS_AB_BUDGET", "0"))
    method = torchalpa.AutoParallel(time_budget_s=budget) if budget else None
    plan = torchalpa.plan(model, batch, workload.loss_fn, cluster=torchalpa.Cluster.h100(1, 8),
                          mixed_precision=bf16, method=method)
    wall = time.perf_counter() - start
    text = plan_text(plan)
    root = os.path.dirname(os.path.dirname(os.path.abspath(torchalpa.__file__)))
    with open(os.environ.get("VIEW_CUTS_AB_JSON", os.devnull), "w") as f:
        f.write(text)
    print(json.dumps({
        "wall": wall, "est": plan.estimates.step_time_s, "tree": root,
        "method": f"remat={plan.method.get('remat')}, "
                  f"{plan.method.get('num_micro_batches', 1)} micro-batches, mesh "
                  f"{'x'.join(map(str, plan.mesh_shape))}",
        "hash": hashlib.sha256(text.encode()).hexdigest()[:16],
        "notes": [n for n in plan.notes
                  if n.startswith(("AutoParallel", "runner-up", "  tried"))]}))


def _link(base: str) -> None:
    """``base``'s top-level packages where ``torchalpa.`` finds them (as setup.cfg maps)."""
    for name in ("passes", "frontends", "runtime"):
        link = os.path.join(base, "torchalpa", name)
        if not os.path.exists(link):
            os.symlink(os.path.join("..", name), link)


def run(tree: str | None, out_dir: str, budget: float = 0.0) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHALPA_CACHE="0", TORCHALPA_LOG="warning",
               VIEW_CUTS_AB_JSON=os.path.join(out_dir, f"{'old' if tree else 'new'}.json"),
               VIEW_CUTS_AB_BUDGET=str(budget))
    if tree is not None:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env,
                         capture_output=True, text=True, check=True, cwd=tree or None).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    found = json.loads(out.strip().splitlines()[-1])
    # the child and the workers it forked and waited for: what the load moves less
    found["cpu"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="a pristine copy of the commit to compare with")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default=".", help="where old.json and new.json (the plans "
                   "hashed, for diff) are written")
    p.add_argument("--no-clock", action="store_true", help="lift the search's 600-s safety "
                   "net (time_budget_s) in both trees")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child()
        return
    if not args.base:
        p.error("--base is needed")
    _link(args.base)
    walls: dict[str, list[float]] = {"old": [], "new": []}
    cpus: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(args.rounds):
        for label, tree in (("old", args.base), ("new", None)):
            found = run(tree, args.out, 1e6 if args.no_clock else 0.0)
            walls[label].append(found["wall"])
            cpus[label].append(found["cpu"])
            print(f"{label}: {found['wall']:7.1f} s wall, {found['cpu']:7.1f} s CPU (child and "
                  f"its workers; load {os.getloadavg()[0]:.1f}) est "
                  f"{found['est']:.4g} s/step, {found['method']}, plan {found['hash']} "
                  f"[{found['tree']}]", flush=True)
            for note in found["notes"]:
                print(f"    {note}", flush=True)
    ratios = [n / o for n, o in zip(walls["new"], walls["old"])]
    print("new/old wall: " + ", ".join(f"{r:.3f}" for r in ratios))
    ratios = [n / o for n, o in zip(cpus["new"], cpus["old"])]
    print("new/old CPU: " + ", ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
