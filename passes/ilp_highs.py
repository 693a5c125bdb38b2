"""The intra-op ILP handed to HiGHS as arrays, without building a PuLP model first.

``passes/ilp.py`` states the problem (one-hot strategy choices, layout-pair edge variables,
memory groups) and reduces it; with ``solver="highs"`` this module writes that same
model straight into ``highspy``. Profiling the pipeline search (GPT-1.3B on 4 H100s, 58
intra-op solves) showed PuLP's model building -- one Python object per variable and per
term, then a copy into HiGHS column by column -- taking longer than HiGHS itself.

The model is column for column and row for row the one PuLP would hand to HiGHS (PuLP
orders columns by variable name, rows as added; the names are reproduced only to sort
by them), so the solver, single-threaded and seeded, returns the same choice: the fast
path changes how long a solve takes, never which plan it finds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import highspy
import numpy as np

__all__ = ["HighsResult", "solve_with_highs"]


@dataclass
class HighsResult:
    """What the solve found: the index chosen per decided node (in ``costs`` order, None
    for nodes with one strategy), the peak variable's value (``minimize_peak``), and the
    model's size."""

    choice: dict[str, int]
    status: str
    peak: float | None
    num_variables: int
    num_constraints: int


class _Model:
    """Columns (named as PuLP would name them) and rows in CSR form, built in bulk."""

    def __init__(self):
        self.names: list[str] = []
        self.cost: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.starts: list[int] = []
        self.index: list[int] = []
        self.value: list[float] = []

    def column(self, name: str, cost: float, upper: float, integer: bool) -> int:
        self.names.append(name)
        self.cost.append(cost)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.names) - 1

    def row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        self.starts.append(len(self.index))
        for col, coefficient in terms:
            if coefficient != 0:
                self.index.append(col)
                self.value.append(coefficient)
        self.row_lower.append(lower)
        self.row_upper.append(upper)


def solve_with_highs(costs: dict[str, np.ndarray], edges: list, reduced, memory_terms: list,
                     memory_budget: float | None, minimize_peak: bool, scale: float, *,
                     time_limit: float | None, gap: float | None, verbose: bool
                     ) -> HighsResult:
    """Solve the reduced problem (``presolve``'s costs and edges, costs to be multiplied
    by ``scale``) with HiGHS; ``reduced`` supplies the bytes of nodes it decided."""
    inf = highspy.kHighsInf
    model = _Model()
    allowed = {k: np.isfinite(c) for k, c in costs.items()}
    s: dict[str, list[int | None]] = {}
    single = {k for k, c in costs.items() if len(c) == 1}   # decided: a constant 1, as PuLP
    for idx, (k, c) in enumerate(costs.items()):
        if len(c) == 1:
            continue
        cols = [model.column(f"s{idx}_{a}", float(c[a] * scale), 1.0, True)
                if allowed[k][a] else None for a in range(len(c))]
        model.row([(col, 1.0) for col in cols if col is not None], 1.0, 1.0)
        s[k] = cols
    for eidx, e in enumerate(edges):
        P, Q = e.table.shape
        row_sources = _sources(s, single, e.u, e.row_of, P)
        col_sources = _sources(s, single, e.v, e.col_of, Q)
        rows: list[list[int]] = [[] for _ in range(P)]
        cols_of: list[list[int]] = [[] for _ in range(Q)]
        for p in range(P):
            if not row_sources[p]:
                continue
            for q in range(Q):
                if not col_sources[q] or not math.isfinite(e.table[p, q]):
                    continue
                col = model.column(f"e{eidx}_{p}_{q}", float(e.table[p, q] * scale), 1.0, False)
                rows[p].append(col)
                cols_of[q].append(col)
        for sums, sources in ((rows, row_sources), (cols_of, col_sources)):
            for held, source in zip(sums, sources):
                if source:   # sum of e over the layout == sum of s writing (reading) it
                    ones = float(sum(1 for c in source if c is None))
                    model.row([(c, 1.0) for c in held] +
                              [(c, -1.0) for c in source if c is not None], ones, ones)
    peak = model.column("peak_bytes", 0.0, inf, False) if minimize_peak else None
    if memory_budget is not None or peak is not None:
        mem_scale = 1.0 / max(1.0, max((float(np.max(m)) for g in memory_terms
                                        for m in g.values()), default=1.0))
        for group in memory_terms:
            terms, fixed = [], 0.0
            for k, mem in group.items():
                if k not in costs:
                    fixed += reduced.fixed_bytes(k, mem) * mem_scale
                elif k not in s:
                    fixed += float(mem[0]) * mem_scale
                else:
                    terms += [(s[k][a], float(mem[a]) * mem_scale) for a in range(len(mem))
                              if s[k][a] is not None and mem[a] != 0]
            if peak is not None:
                model.row(terms + [(peak, -1.0)], -inf, -fixed)
            else:
                assert memory_budget is not None
                model.row(terms, -inf, memory_budget * mem_scale - fixed)
    if peak is not None:    # the objective is the peak alone
        model.cost = [0.0] * len(model.cost)
        model.cost[peak] = 1.0
    if model.names:
        status, values = _solve(model, time_limit=time_limit, gap=gap, verbose=verbose)
    else:   # presolve decided every node (HiGHS calls an empty model an error; PuLP pads it)
        status, values = "Optimal", np.zeros(0)
    choice = {k: int(np.argmax([0.0 if c is None else values[c] for c in cols]))
              for k, cols in s.items()}
    return HighsResult(choice=choice, status=status,
                       peak=None if peak is None else float(values[peak]),
                       num_variables=len(model.names), num_constraints=len(model.row_lower))


def _sources(s: dict, single: set, node: str, layout_of: np.ndarray, size: int
             ) -> list[list[int | None]]:
    """Per layout, the columns of ``node``'s strategies that use it (None: a node with one
    strategy, the constant 1)."""
    out: list[list[int | None]] = [[] for _ in range(size)]
    if node in single:
        out[int(layout_of[0])].append(None)
        return out
    for a, p in enumerate(layout_of):
        if s[node][a] is not None:
            out[int(p)].append(s[node][a])
    return out


def _solve(model: _Model, *, time_limit: float | None, gap: float | None, verbose: bool
           ) -> tuple[str, np.ndarray]:
    """Load the model in PuLP's column order (sorted by name), run HiGHS on it, and return
    (PuLP's status name, column values in the model's own order)."""
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
    n = len(order)
    cost = np.asarray(model.cost, dtype=np.float64)[order]
    upper = np.asarray(model.upper, dtype=np.float64)[order]
    h.addCols(n, cost, np.zeros(n), upper, 0, np.zeros(0, dtype=np.int32),
              np.zeros(0, dtype=np.int32), np.zeros(0))
    integer = np.flatnonzero(np.asarray(model.integer, dtype=bool)[order]).astype(np.int32)
    if integer.size:
        h.changeColsIntegrality(integer.size, integer,
                                np.full(integer.size, highspy.HighsVarType.kInteger))
    if model.row_lower:
        h.addRows(len(model.row_lower), np.asarray(model.row_lower, dtype=np.float64),
                  np.asarray(model.row_upper, dtype=np.float64), len(model.index),
                  np.asarray(model.starts, dtype=np.int32),
                  position[np.asarray(model.index, dtype=np.int64)].astype(np.int32),
                  np.asarray(model.value, dtype=np.float64))
    h.run()
    status, values = _read(h)
    return status, values[position] if values.size == n else np.zeros(n)


_STATUS = {
    "kOptimal": "Optimal", "kObjectiveBound": "Optimal", "kObjectiveTarget": "Optimal",
    "kInterrupt": "Optimal", "kTimeLimit": "Optimal", "kIterationLimit": "Optimal",
    "kInfeasible": "Infeasible", "kUnboundedOrInfeasible": "Infeasible",
    "kUnbounded": "Unbounded",
}
"""HiGHS model status -> PuLP's status name, as PuLP's HiGHS interface maps them (a time
limit with a solution found counts as solved; anything else not listed as not solved)."""


def _read(h: highspy.Highs) -> tuple[str, np.ndarray]:
    """(PuLP status name, column values in HiGHS's order); raises nothing."""
    status = h.getModelStatus()
    name = _STATUS.get(status.name, "Not Solved")
    if name == "Optimal" and status.name in ("kTimeLimit", "kIterationLimit", "kInterrupt") \
            and not math.isfinite(h.getInfo().objective_function_value):
        name = "Not Solved"
    return name, np.asarray(h.getSolution().col_value, dtype=np.float64)
