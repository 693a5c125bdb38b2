"""What a saved stage ILP's solve could save, lever by lever, at best: each model of
``highs_dump.py``'s corpus solved as the planner runs it, then with a lever whose best
case needs the planner's own answer (so none of these is a setting to adopt; each is the
most such a lever could cut), one after the other in one process.

    python benchmarks/stage_levers_ab.py /tmp/corpus/stage/*.npz --levers answer_start

Levers:

- ``answer_start``: the planner's own plan (its integer columns) handed to HiGHS as the
  start: the best any MIP start could do (the layers' own plans, a neighbouring stage's).
- ``cutoff_above``: HiGHS' ``objective_bound`` just above the planner's objective (1e-6
  relative): the best any cutoff that keeps the answer could do.
- ``cutoff_below``: ``objective_bound`` 0.1 % below it: what proving a stage's price
  above a cutoff costs, for a stage whose price the search could not use.
- ``no_memory``: the memory rows (the only rows without a lower bound) dropped: whether
  they bind (another plan, a lower objective) and what they cost the solver.
- ``lp_bound``: the model's linear relaxation as the search's LP bounds solve it
  (``ilp_highs.linear_optimum``): what refusing a stage by its bound, unsolved, costs.

Per model and lever: HiGHS' CPU seconds, simplex iterations, nodes, objective, status,
and whether the integer columns are the planner's (``same``); for the planner's own run
also the least relative slack of its memory rows at its answer (0: a row binds).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from highs_dump import load_model  # noqa: E402
from highs_options_ab import Run, same_choice  # noqa: E402

from torchalpa.passes.sharding import ilp_highs  # noqa: E402
from torchalpa.passes.sharding.ilp_model import LinearModel  # noqa: E402

LEVERS = ("answer_start", "cutoff_above", "cutoff_below", "no_memory", "lp_bound")


def solve(model: LinearModel, limits: dict, options: dict | None = None) -> tuple[Run, np.ndarray]:
    """``model`` solved as the planner solves it (``limits``: its gap, nodes and clock),
    with HiGHS ``options`` laid over; the run and the column values in model order."""
    max_nodes = None if limits["max_nodes"] is None else int(limits["max_nodes"])
    h, position = ilp_highs.started_highs(model, time_limit=limits["time_limit"],
                                          gap=limits["gap"], verbose=False,
                                          max_nodes=max_nodes, options=options)
    start = time.process_time()
    h.run()
    cpu = time.process_time() - start
    info = h.getInfo()
    values = np.asarray(h.getSolution().col_value, dtype=np.float64)
    values = values[position] if values.size == len(model.names) else np.zeros(0)
    integer = np.asarray(model.integer, dtype=bool)
    chosen = np.round(values[integer]) if values.size else np.zeros(0)
    return Run(cpu, int(info.simplex_iteration_count), int(info.mip_node_count),
               float(info.objective_function_value), h.getModelStatus().name, chosen), values


def memory_rows(model: LinearModel) -> list[int]:
    """The memory rows: ``ilp_model.build_model`` writes them, and only them, without a
    lower bound."""
    return [r for r, lower in enumerate(model.row_lower) if lower == -math.inf]


def least_memory_slack(model: LinearModel, values: np.ndarray) -> float | None:
    """The least (upper - activity) / upper over the memory rows at ``values``."""
    rows = memory_rows(model)
    if not rows or not values.size:
        return None
    ends = model.starts[1:] + [len(model.index)]
    slack = math.inf
    for r in rows:
        begin, end = model.starts[r], ends[r]
        activity = float(np.dot(values[model.index[begin:end]], model.value[begin:end]))
        upper = model.row_upper[r]
        slack = min(slack, (upper - activity) / max(abs(upper), 1e-12))
    return slack


def without_memory_rows(model: LinearModel) -> LinearModel:
    """``model`` less its memory rows (``memory_rows``)."""
    drop = set(memory_rows(model))
    out = LinearModel(names=model.names, cost=model.cost, upper=model.upper,
                      integer=model.integer, initial=model.initial)
    ends = model.starts[1:] + [len(model.index)]
    for r, (begin, end) in enumerate(zip(model.starts, ends)):
        if r in drop:
            continue
        out.starts.append(len(out.index))
        out.index += model.index[begin:end]
        out.value += model.value[begin:end]
        out.row_lower.append(model.row_lower[r])
        out.row_upper.append(model.row_upper[r])
    return out


def lever_run(lever: str, model: LinearModel, limits: dict, base: Run) -> Run:
    """``model`` solved with ``lever`` (see the module doc), ``base`` the planner's run."""
    if lever == "answer_start":
        integer = np.flatnonzero(np.asarray(model.integer, dtype=bool))
        started = LinearModel(**{**vars(model), "initial": dict(zip(
            integer.tolist(), base.chosen.tolist()))})
        return solve(started, limits)[0]
    if lever in ("cutoff_above", "cutoff_below"):
        factor = 1 + 1e-6 if lever == "cutoff_above" else 1 - 1e-3
        return solve(model, limits, {"objective_bound": base.objective * factor})[0]
    if lever == "lp_bound":
        start = time.process_time()
        bound = ilp_highs.linear_optimum(model)
        return Run(time.process_time() - start, 0, 0, math.nan if bound is None else bound,
                   "LP", np.zeros(0))
    assert lever == "no_memory", lever
    return solve(without_memory_rows(model), limits)[0]


def line(name: str, lever: str, run: Run, base: Run, extra: str = "") -> str:
    same = same_choice(run, base)
    rel = (run.objective - base.objective) / max(abs(base.objective), 1e-9)
    return (f"{name:40s} {lever:13s} cpu {run.cpu:7.2f}  it {run.iterations:7d}  "
            f"nodes {run.nodes:5d}  obj {run.objective:.10g} ({rel:+.2e})  {run.status:16s} "
            f"{'same' if same else 'DIFFERENT'}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="saved models (.npz)")
    parser.add_argument("--levers", nargs="+", default=list(LEVERS), choices=LEVERS)
    args = parser.parse_args()
    for path in args.models:
        name = "/".join(path.split(os.sep)[-2:])[:-4]
        model, limits = load_model(path)
        base, values = solve(model, limits)
        slack = least_memory_slack(model, values)
        print(line(name, "base", base, base, f"  memory rows {len(memory_rows(model))}, "
                   f"least slack {slack if slack is None else f'{slack:.2e}'}"), flush=True)
        for lever in args.levers:
            print(line(name, lever, lever_run(lever, model, limits, base), base), flush=True)


if __name__ == "__main__":
    main()
