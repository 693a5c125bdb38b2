"""The intra-op ILP's arrays (``passes/sharding/ilp_model.py``) handed to HiGHS without PuLP.

HiGHS takes columns and CSR rows as arrays, so the model goes in with a few calls instead
of one Python object per variable and per term. Columns are loaded in PuLP's order (sorted
by name) and rows in the order they were built, so the solver, single-threaded and seeded,
returns the same choice as PuLP's HiGHS interface would: this path changes how long a
solve takes, never which plan it finds.
"""

from __future__ import annotations

import math

import highspy
import numpy as np

from torchalpa.passes.sharding.ilp_model import LinearModel

__all__ = ["solve_with_highs", "started_highs", "linear_optimum", "MIP_OPTIONS", "LP_OPTIONS"]

MIP_OPTIONS: dict[str, bool | int | float | str] = {}
"""HiGHS options of the planner's MIP runs that differ from HiGHS' defaults: none. Weighed
on a corpus of the planner's own ILPs (``benchmarks/highs_options_ab.py``;
benchmarks/RESULTS.md, "HiGHS options on the planner's own ILPs"), the settings that cut
work (presolve off, feasibility jump off) return another plan of the same objective where
plans tie or end at another plan within the gap, and the others (restarts, symmetry,
sub-MIP heuristics, heuristic effort) cut little more than the load's noise."""


LP_OPTIONS: dict[str, bool | int | float | str] = {"presolve": "off"}
"""HiGHS options of the linear relaxations ``linear_optimum`` solves (the search's LP
bounds) that differ from HiGHS' defaults. HiGHS' presolve spends more on these LPs than
it saves: on target a's views (220-330 thousand columns) the dual simplex takes about as
many iterations without it and a third to a quarter of the CPU seconds, to the same
optimum (an LP's optimal value does not depend on the path; on the LPs measured it
agreed to 15 digits or more: benchmarks/RESULTS.md, "Target a's bounds phase"). The
MIPs keep the defaults (``MIP_OPTIONS``): there presolve shapes which of several tied
plans is returned."""


def solve_with_highs(model: LinearModel, *, time_limit: float | None, gap: float | None,
                     verbose: bool, max_nodes: int | None = None
                     ) -> tuple[str, np.ndarray, bool]:
    """Run HiGHS on ``model``; return (PuLP's status name, column values in the model's
    own order, whether the time limit stopped it). ``max_nodes``: HiGHS'
    ``mip_max_nodes``, a bound by work (the same plan at any load). ``model.initial``
    (strategy columns of a feasible plan) is handed to HiGHS as a partial start, which it
    completes (the edge columns follow from the strategies) and keeps as its incumbent: a
    solve stopped by a limit returns at least that plan."""
    if not model.names:     # presolve decided every node (HiGHS calls an empty model an error)
        return ("Optimal" if _empty_feasible(model) else "Infeasible"), np.zeros(0), False
    h, position = started_highs(model, time_limit=time_limit, gap=gap, verbose=verbose,
                                max_nodes=max_nodes)
    h.run()
    clock = h.getModelStatus().name == "kTimeLimit"
    status, values = _read(h)
    n = len(model.names)
    return status, values[position] if values.size == n else np.zeros(n), clock


def started_highs(model: LinearModel, *, time_limit: float | None, gap: float | None,
                  verbose: bool, max_nodes: int | None = None,
                  options: dict[str, bool | int | float | str] | None = None
                  ) -> tuple[highspy.Highs, np.ndarray]:
    """A HiGHS instance holding ``model`` with its partial start set, ready to ``run``, and
    each model column's position there (``_load``), with ``MIP_OPTIONS`` set and then
    ``options`` over them (``benchmarks/highs_options_ab.py`` weighs settings this way)."""
    h, position = _load(model, time_limit=time_limit, gap=gap, verbose=verbose,
                        max_nodes=max_nodes)
    for name, value in {**MIP_OPTIONS, **(options or {})}.items():
        if h.setOptionValue(name, value) == highspy.HighsStatus.kError:
            raise ValueError(f"HiGHS refused option {name}={value!r}")
    if model.initial:
        columns = np.fromiter(model.initial.keys(), dtype=np.int64, count=len(model.initial))
        h.setSolution(len(columns), position[columns].astype(np.int32),
                      np.fromiter(model.initial.values(), dtype=np.float64,
                                  count=len(columns)))
    return h, position


def linear_optimum(model: LinearModel, *, integral: bool = False) -> float | None:
    """The optimum of ``model`` with every column continuous (its linear relaxation, solved
    under ``LP_OPTIONS``; with ``integral=True`` the model as it is, under HiGHS'
    defaults), in the model's scaled units; None when it has no feasible point."""
    if not model.names:
        return 0.0 if _empty_feasible(model) else None
    h, _ = _load(model, time_limit=None, gap=None, verbose=False, integral=integral)
    if not integral:
        for name, value in LP_OPTIONS.items():
            h.setOptionValue(name, value)
    h.run()
    if h.getModelStatus().name != "kOptimal":
        return None
    return float(h.getInfo().objective_function_value)


def _empty_feasible(model: LinearModel) -> bool:
    """Whether a model without columns is feasible: each row is then a constant 0 between
    its bounds (a memory budget that what was decided already exceeds breaks one)."""
    return all(lo <= 1e-9 and up >= -1e-9 for lo, up in zip(model.row_lower, model.row_upper))


def _load(model: LinearModel, *, time_limit: float | None, gap: float | None, verbose: bool,
          integral: bool = True, max_nodes: int | None = None
          ) -> tuple[highspy.Highs, np.ndarray]:
    """A HiGHS instance holding ``model`` (columns in PuLP's order: sorted by name), and
    each model column's position there."""
    order = sorted(range(len(model.names)), key=model.names.__getitem__)
    position = np.empty(len(order), dtype=np.int32)
    position[order] = np.arange(len(order), dtype=np.int32)
    h = highspy.Highs()
    if not verbose:
        h.setOptionValue("output_flag", False)
    if gap is not None:
        h.setOptionValue("mip_rel_gap", gap)
    h.setOptionValue("threads", 1)
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("random_seed", 0)
    if max_nodes is not None:
        h.setOptionValue("mip_max_nodes", int(max_nodes))
    n = len(order)
    cost = np.asarray(model.cost, dtype=np.float64)[order]
    upper = np.asarray(model.upper, dtype=np.float64)[order]
    h.addCols(n, cost, np.zeros(n), upper, 0, np.zeros(0, dtype=np.int32),
              np.zeros(0, dtype=np.int32), np.zeros(0))
    integer = np.flatnonzero(np.asarray(model.integer, dtype=bool)[order]).astype(np.int32)
    if integral and integer.size:
        h.changeColsIntegrality(integer.size, integer,
                                np.full(integer.size, highspy.HighsVarType.kInteger))
    if model.row_lower:
        status = h.addRows(len(model.row_lower), np.asarray(model.row_lower, dtype=np.float64),
                           np.asarray(model.row_upper, dtype=np.float64), len(model.index),
                           np.asarray(model.starts, dtype=np.int32),
                           position[np.asarray(model.index, dtype=np.int64)].astype(np.int32),
                           np.asarray(model.value, dtype=np.float64))
        # a refused row set (a column twice in one row) leaves HiGHS a model without rows,
        # which it solves "optimally" with every column 0
        if status == highspy.HighsStatus.kError:
            raise ValueError("HiGHS refused the ILP's rows (a column repeated in a row?)")
    return h, position


_STATUS = {
    "kOptimal": "Optimal", "kObjectiveBound": "Optimal", "kObjectiveTarget": "Optimal",
    "kInterrupt": "Optimal", "kTimeLimit": "Optimal", "kIterationLimit": "Optimal",
    "kSolutionLimit": "Optimal",
    "kInfeasible": "Infeasible", "kUnboundedOrInfeasible": "Infeasible",
    "kUnbounded": "Unbounded",
}
"""HiGHS model status -> PuLP's status name, as PuLP's HiGHS interface maps them (a time
limit with a solution found counts as solved; anything else not listed as not solved),
and the node limit too: HiGHS ends a search stopped by ``mip_max_nodes`` with
``kSolutionLimit``, which PuLP's table lacks, and that stop by work keeps its incumbent
(``max_nodes``: "the best plan found by then is used"), where it used to raise
``SolverStopped`` as if no plan had been found."""
_STOPPED = ("kTimeLimit", "kIterationLimit", "kInterrupt", "kSolutionLimit")
"""Statuses of a run a limit ended: solved only where it holds an incumbent."""


def _read(h: highspy.Highs) -> tuple[str, np.ndarray]:
    """(PuLP status name, column values in HiGHS's order); raises nothing."""
    status = h.getModelStatus()
    name = _STATUS.get(status.name, "Not Solved")
    if name == "Optimal" and status.name in _STOPPED \
            and not math.isfinite(h.getInfo().objective_function_value):
        name = "Not Solved"
    return name, np.asarray(h.getSolution().col_value, dtype=np.float64)
