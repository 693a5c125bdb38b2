"""AutoParallel on a near-budget job, two trees back to back: planning time and the plan.

The tiny GPT of tests/test_auto.py (2 layers, batch 8) on 4 H100 views with the host's
per-op time left out, under a memory budget of 0.9 of its plain step's bound (what
``test_auto_uses_checkpointing_or_micro_batches_when_the_step_does_not_fit`` planned
until 11-29; it now plans batch 64, where activations dominate and the search is short): the
plain step cannot fit, and the candidates that can (per-layer and selective
checkpointing) sit just under the budget, where HiGHS branches on nearly binding memory
rows. The base tree (``git archive <base>``, default main) and this one each plan it in a
fresh process, one after the other:

    python benchmarks/near_budget_ab.py                 # base main, views in this process
    python benchmarks/near_budget_ab.py --workers 2     # views in forked processes, as the test
    python benchmarks/near_budget_ab.py --base HEAD~1 --fraction 0.95

Each line: wall and CPU seconds of ``torchalpa.plan`` (capture included), the ILP solves
(count, seconds, the slowest, how many the 60 s time limit stopped -- counted in this
process only, so with ``--workers 1``), the plan's estimate and peak; then the ratios.
No plan cache. Wall-clock figures on a shared machine: the load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _layout(tree: str, into: str) -> str:
    """A directory laid out as the installed package (setup.cfg's package_dir), with
    symlinks into ``tree``, to put first on PYTHONPATH (as ``make lint`` does)."""
    package = os.path.join(into, "torchalpa")
    os.makedirs(package)
    for name in os.listdir(os.path.join(tree, "torchalpa")):
        os.symlink(os.path.join(tree, "torchalpa", name), os.path.join(package, name))
    for name in ("frontends", "passes", "runtime"):
        os.symlink(os.path.join(tree, name), os.path.join(package, name))
    return into


def near_budget_job(fraction: float):
    """The job these scripts plan, with the ``torchalpa`` imported here: the tiny GPT (2
    layers, batch 8, on meta) and 1 x 4 H100 with the host's per-op time left out, whose
    memory per device is ``fraction`` of the plain step's bound: (model, batch, loss_fn,
    cluster)."""
    import dataclasses

    import torch

    import torchalpa
    import torchalpa.models as zoo
    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.pricing.bounds import step_profile

    workload = zoo.tiny("gpt", batch_size=8, dropout=0.0, num_layers=2)
    with torch.device("meta"):
        model = workload.build()
    batch = workload.example_inputs(device="meta")
    cluster = dataclasses.replace(torchalpa.Cluster.h100(1, 4), host_op_s=0.0)
    budget = step_profile(capture(model, batch, workload.loss_fn).graph,
                          cluster).memory_bytes(4) * fraction
    return (model, batch, workload.loss_fn,
            dataclasses.replace(cluster, memory_per_device=budget))


def child(fraction: float, workers: int) -> dict:
    """Plan the job in this process; what the parent prints."""
    os.environ["TORCHALPA_CACHE"] = "0"
    import torchalpa
    import torchalpa.passes.sharding.intra_op as intra_op
    from torchalpa.passes.pipeline_search import stage_jobs

    if workers:
        stage_jobs.cpu_workers = lambda: workers
    solves: list[tuple[float, bool]] = []
    solve_ilp = intra_op.solve_ilp

    def counted(*args, **kwargs):
        solution = solve_ilp(*args, **kwargs)
        solves.append((solution.seconds, solution.clock_stopped))
        return solution

    intra_op.solve_ilp = counted
    model, batch, loss_fn, cluster = near_budget_job(fraction)
    wall, cpu = time.perf_counter(), time.process_time()
    plan = torchalpa.plan(model, batch, loss_fn, cluster=cluster)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    chosen = next((n for n in plan.notes if n.startswith("AutoParallel chose")), "")
    return {"wall": wall, "cpu": cpu, "solves": len(solves),
            "solve_s": sum(s for s, _ in solves), "slowest": max((s for s, _ in solves), default=0),
            "clock": sum(c for _, c in solves), "step": plan.estimates.step_time_s,
            "peak": plan.estimates.memory_per_device_bytes,
            "budget": cluster.memory_per_device,
            "chosen": chosen, "source": torchalpa.__file__}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="main", help="git ref of the tree to compare against")
    p.add_argument("--fraction", type=float, default=0.9,
                   help="the budget as a fraction of the plain step's memory bound")
    p.add_argument("--workers", type=int, default=1,
                   help="processes for the views (0: the machine's cores, as the test)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.fraction, args.workers)))
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="near_budget_ab-") as tmp:
        base = os.path.join(tmp, "base")
        os.makedirs(base)
        archive = subprocess.run(["git", "-C", ROOT, "archive", args.base], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
        for name, tree in (("base", base), ("this", ROOT)):
            env = dict(os.environ, PYTHONPATH=_layout(tree, os.path.join(tmp, "path-" + name)),
                       OMP_NUM_THREADS="1")
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                  "--fraction", str(args.fraction), "--workers",
                                  str(args.workers)], env=env, cwd=tmp, check=True,
                                 capture_output=True, text=True).stdout
            r = results[name] = json.loads(out.strip().splitlines()[-1])
            assert r["source"].startswith(os.path.join(tmp, "path-" + name)), r["source"]
            print(f"{name:>4} ({args.base if name == 'base' else 'working tree'}): "
                  f"{r['wall']:.1f} s wall, {r['cpu']:.1f} s CPU | {r['solves']} ILP solves, "
                  f"{r['solve_s']:.1f} s, slowest {r['slowest']:.1f} s, {r['clock']} stopped by "
                  f"the time limit | est {r['step'] * 1e3:.6f} ms/step, "
                  f"{r['peak'] / 1024:.1f} of {r['budget'] / 1024:.1f} KiB | {r['chosen']}",
                  flush=True)
    old, new = results["base"], results["this"]
    print(f"ratios base/this: wall {old['wall'] / new['wall']:.2f}x, CPU "
          f"{old['cpu'] / new['cpu']:.2f}x, ILP seconds {old['solve_s'] / max(new['solve_s'], 1e-9):.2f}x"
          f"; estimate this/base {new['step'] / old['step']:.6f} "
          f"({'equal or better' if new['step'] <= old['step'] * (1 + 1e-12) else 'WORSE'}); "
          f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
