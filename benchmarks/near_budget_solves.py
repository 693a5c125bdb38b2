"""Where a near-budget AutoParallel search spends its time: every HiGHS run, tagged.

The job of ``benchmarks/near_budget_ab.py`` (the tiny GPT under 0.9 of its plain step's
memory bound, 4 H100 views), planned once in this process with the views solved one after
another (no forked workers, so every solve is seen here):

    python benchmarks/near_budget_solves.py              # this tree
    python benchmarks/in_tree.py <another tree> benchmarks/near_budget_solves.py

One line per candidate view (seconds), one per HiGHS run: the candidate, the view, the
model's columns and rows (memory rows among them), whether a start was given, seconds,
HiGHS' status, branch-and-bound nodes, the gap left and the objective; then the plan's
notes and the totals. No plan cache.
"""

from __future__ import annotations

import os
import time

os.environ["TORCHALPA_CACHE"] = "0"


from near_budget_ab import near_budget_job  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.passes.sharding.ilp_highs as ilp_highs  # noqa: E402
import torchalpa.passes.sharding.intra_op as intra_op  # noqa: E402
from torchalpa.parallel import auto  # noqa: E402
from torchalpa.passes.pipeline_search import stage_jobs  # noqa: E402

TAG = {"candidate": "", "view": ""}
RUNS: list[str] = []
_load, _solve, _plan_view, _candidate = (ilp_highs._load, ilp_highs.solve_with_highs,
                                         intra_op.plan_intra_op, auto._Search.solve)
_last = {}


def load(model, **kwargs):
    h, position = _load(model, **kwargs)
    _last["h"] = h
    return h, position


def solve(model, **kwargs):
    start = time.perf_counter()
    out = _solve(model, **kwargs)
    seconds = time.perf_counter() - start
    h = _last.pop("h", None)
    memory = sum(1 for lo, up in zip(model.row_lower, model.row_upper)
                 if lo == float("-inf") and up not in (0.0, 1.0))
    if h is None:
        RUNS.append(f"{TAG['candidate']:<58} {TAG['view']:<4} (presolve decided every node)")
        return out
    info = h.getInfo()
    RUNS.append(f"{TAG['candidate']:<58} {TAG['view']:<4} cols {len(model.names):>5} rows "
                f"{len(model.row_lower):>5} (memory {memory:>2}) start {int(bool(model.initial))} "
                f"{seconds:6.2f} s {h.getModelStatus().name:<11} nodes {info.mip_node_count:>4} "
                f"gap {info.mip_gap:.2g} obj {info.objective_function_value:.7g} "
                f"(mip_rel_gap {kwargs.get('gap')})")
    return out


def plan_view(graph, mesh, *args, **kwargs):
    TAG["view"] = "x".join(map(str, mesh.shape))
    start = time.perf_counter()
    try:
        return _plan_view(graph, mesh, *args, **kwargs)
    finally:
        print(f"  view {TAG['view']} of {TAG['candidate']}: "
              f"{time.perf_counter() - start:.1f} s", flush=True)


def candidate(self, c, settled=None):
    TAG["candidate"] = c.describe()
    return _candidate(self, c, settled)


def main() -> None:
    stage_jobs.cpu_workers = lambda: 1
    ilp_highs._load, ilp_highs.solve_with_highs = load, solve
    intra_op.plan_intra_op, auto._Search.solve = plan_view, candidate
    model, batch, loss_fn, cluster = near_budget_job(0.9)
    start = time.perf_counter()
    plan = torchalpa.plan(model, batch, loss_fn, cluster=cluster)
    seconds = time.perf_counter() - start
    print("\n".join(RUNS))
    for note in plan.notes:
        if "cannot beat" not in note and "an intra-op plan fits" not in note:
            print("  note:", note)
    print(f"planned in {seconds:.1f} s (load {os.getloadavg()[0]:.1f}); {len(RUNS)} HiGHS runs; "
          f"est {plan.estimates.step_time_s!r} s/step, {plan.estimates.memory_per_device_bytes} "
          f"of {cluster.memory_per_device:.0f} B")


if __name__ == "__main__":
    main()
