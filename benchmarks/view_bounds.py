"""How close each intra-op view's LP bound is to the plan its ILP gives, and what each costs.

    OMP_NUM_THREADS=1 python benchmarks/view_bounds.py [--layers 32]

Plans target a of ``auto_targets.py`` (LLaMA-3-8B bf16, batch 16 x 8192, 1 x 8 H100) with
AutoParallel, its views uncut (``SearchSwitches.view_bounds`` off: every view the search
solved before LP bounds cut any), keeping every view (candidate x logical mesh) it solved; then, for
each, computes ``passes/sharding/intra_op.step_time_lower_bound`` on the same capture and
method with the graph's blocks (the LP relaxation of the least simplified problem its ILP may
solve: what ``view_cuts.py`` cuts by). One row per view: the solved estimate, the bound,
bound/estimate, bound/best (the best estimate of every view), whether the cut rule would cut
it with the best plan in hand (``bound * (1 + tolerance) >= best``), the LP's CPU seconds
(this process) and the view's solve seconds (``plan.estimates.solve_seconds``, wall, in its
worker process). ``--layers`` plans a shallower model (quicker).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TORCHALPA_CACHE", "0")

import torch  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402
from torchalpa.core.switches import SearchSwitches  # noqa: E402
from torchalpa.parallel import auto  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=None, help="layers of the model (default 32)")
    args = p.parse_args()
    workload = zoo.llama3_8b()
    if args.layers is not None:
        workload = workload.replace(num_layers=args.layers)
    with torch.device("meta"):
        model = workload.build()
    batch = workload.example_inputs(device="meta")
    cluster = torchalpa.Cluster.h100(1, 8)
    bf16 = torchalpa.MixedPrecision(param_dtype=torch.bfloat16)

    seen: list = []          # (search, candidate, view index, plan)
    record = auto._Search.record_views

    def keep(search, c, outcomes):
        seen.extend((search, c, i, found) for i, found in sorted(outcomes.items())
                    if isinstance(found, torchalpa.Plan))
        return record(search, c, outcomes)

    auto._Search.record_views = keep
    start = time.perf_counter()
    with SearchSwitches.using(view_bounds=False):
        plan = torchalpa.plan(model, batch, workload.loss_fn, cluster=cluster,
                              mixed_precision=bf16)
    print(f"planned in {time.perf_counter() - start:.1f} s (load {os.getloadavg()[0]:.1f}): "
          f"est {plan.estimates.step_time_s:.4g} s/step")
    for note in plan.notes:
        if note.startswith(("AutoParallel", "chosen", "runner-up")):
            print("   ", note)
    auto._Search.record_views = record

    from torchalpa.parallel.shard import blocks_of
    from torchalpa.passes.sharding.intra_op import step_time_lower_bound
    best = min(p.estimates.step_time_s for *_, p in seen)
    tolerance = torchalpa.AutoParallel().tolerance
    print(f"{'candidate':<64} {'view':>4} {'est s':>7} {'bound s':>7} {'b/est':>6} "
          f"{'b/best':>6} {'cut':>3} {'LP cpu s':>8} {'solve s':>7}")
    cut = lp_total = 0.0
    for search, c, i, found in seen:
        mesh = search.meshes[i]
        graph = search.capture(c.num_micro_batches, c.remat, c.regather).graph
        t = time.process_time()
        bound = step_time_lower_bound(graph, mesh, search.intra_op_method(c),
                                      inputs=search.inputs, memo=search.pricing,
                                      blocks=blocks_of(graph))
        lp_s = time.process_time() - t
        lp_total += lp_s
        est = found.estimates.step_time_s
        shape = "x".join(map(str, mesh.shape))
        cuts = bound is not None and bound * (1 + tolerance) >= best
        cut += cuts
        text = "      -      -      -" if bound is None else \
            f"{bound:7.4f} {bound / est:6.3f} {bound / best:6.3f}"
        print(f"{c.describe():<64} {shape:>4} {est:7.4f} {text} {'yes' if cuts else 'no':>3} "
              f"{lp_s:8.1f} {found.estimates.solve_seconds or 0:7.1f}", flush=True)
    print(f"{len(seen)} views solved, {int(cut)} of them cut by their LP bound with the best "
          f"plan ({best:.4g} s/step) in hand; LP bounds {lp_total:.1f} s of CPU in all")


if __name__ == "__main__":
    main()
