"""The step-time lower bound AutoParallel prunes by, beside the published plans' estimates.

    cd benchmarks && python published_bounds.py                 # every single-stage row
    python published_bounds.py --rows romero-gpt2-124m-4090x2 --no-plan

For each published row planned on one stage (``published_rows.py``, ``pp == 1``): the
row's step captured as it ran (``published.pinned_step``: its recomputation, its ZeRO's
parameter reads), the bound of ``passes/pricing/bounds.py`` for the row's micro-batch
count on its cluster (``StepProfile.step_seconds``: what AutoParallel ranks and prunes
candidates by), and the pinned published plan's estimate on that step
(``published.pinned_plan``). A bound is sound when it is at most every plan's estimate:
a bound above the published plan's estimate lets the search skip a candidate that holds
that plan (the RTX 4090 row's, 2026-11-29). ``--no-plan`` prints the bounds alone (seconds
a row; the pinned plan's ILP takes tens of seconds).
"""

from __future__ import annotations

import argparse
import time

from published import pinned_plan, pinned_step
from published_rows import ROWS

from torchalpa.passes.pricing.bounds import step_profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", metavar="ROW", help="rows (default: every pp=1 row)")
    p.add_argument("--no-plan", action="store_true", help="the bounds alone")
    args = p.parse_args()
    rows = [r for r in ROWS if r.pp == 1 and (not args.rows or r.key in args.rows)]
    print(f"{'row':<26}{'bound s':>10}{'pinned est s':>14}{'bound/est':>11}")
    for r in rows:
        start = time.perf_counter()
        graph = pinned_step(r)
        cluster = r.cluster()
        micro_batches = r.global_batch // (r.micro_batch * r.dp)
        profile = step_profile(graph, cluster.logical_mesh((cluster.num_devices,)),
                               eager=not r.fused, optimizer="adam")
        bound = profile.step_seconds(cluster.num_devices, micro_batches, profile.batch)
        if args.no_plan:
            print(f"{r.key:<26}{bound:>10.3f}{'-':>14}{'-':>11}", flush=True)
            continue
        est = pinned_plan(r, graph).estimates.step_time_s
        print(f"{r.key:<26}{bound:>10.3f}{est:>14.3f}{bound / est:>11.3f}  "
              f"({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
