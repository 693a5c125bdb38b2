"""Alpa's intra-op ILP: pick one strategy per node, minimizing node plus edge costs.

For node ``i`` a one-hot vector ``s_i`` over its strategies. An edge's cost depends only
on the layout the producer writes and the layout the consumer reads, and many strategies
share a layout, so each edge is a small table ``T[p, q]`` over distinct layouts with maps
from strategies to rows (``row_of``) and columns (``col_of``). Alpa's linearization, on
layouts: variables ``e[p, q] >= 0`` with ``sum_q e[p, q] = sum_{a: row_of[a] = p} s_u[a]``
and ``sum_p e[p, q] = sum_{b: col_of[b] = q} s_v[b]`` -- with one-hot ``s`` this forces
``e`` to the outer product, so it may be continuous. An infinite entry forbids that pair.
Objective ``sum c_i . s_i + sum T . e``; optional memory constraints
``sum_i m_i . s_i <= budget`` for groups of nodes alive together.

Edges whose table does not depend on one side fold into the other side's node costs, and
``passes/presolve.py`` removes dominated strategies and solves simple nodes in closed form
(both exact) before the rest goes to the solver. Solved with pulp: CBC by default, HiGHS
on request; single-threaded, so the same input gives the same answer.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import pulp

from torchalpa.passes.presolve import presolve
from torchalpa.passes.shared_reshard import SharedReads, add_shared_reads, shared_reads_cost
from torchalpa.progress import solver_verbose

__all__ = ["Edge", "ILPProblem", "ILPSolution", "solve_ilp", "InfeasibleError"]


DIRECT_HIGHS = True
"""Write HiGHS's model as arrays (``passes/ilp_highs.py``) instead of through PuLP: the same
model and answer, built several times faster; False takes the PuLP path (tests compare)."""


class InfeasibleError(ValueError):
    """No choice of strategies satisfies the constraints."""


@dataclass
class Edge:
    """Cost ``table[row_of[a], col_of[b]]`` when ``u`` takes strategy a and ``v`` takes b."""

    u: str
    v: str
    row_of: np.ndarray
    col_of: np.ndarray
    table: np.ndarray

    def dense(self) -> np.ndarray:
        return self.table[np.ix_(self.row_of, self.col_of)]


@dataclass
class ILPProblem:
    node_costs: dict[str, np.ndarray]
    edges: list[Edge] = field(default_factory=list)
    memory_terms: list[dict[str, np.ndarray]] = field(default_factory=list)
    """Groups of per-strategy byte vectors alive together; each group <= the budget."""
    memory_budget: float | None = None
    minimize_peak: bool = False
    """Ignore costs; find the layouts with the smallest largest memory group."""
    shared: list[SharedReads] = field(default_factory=list)
    """Values whose reads pay once per target layout (``passes/shared_reshard.py``); their
    nodes are left out of presolve's rewrites, which assume additive edge costs."""


@dataclass
class ILPSolution:
    choice: dict[str, int]
    objective: float
    status: str
    seconds: float
    num_variables: int = 0
    num_constraints: int = 0


def _cbc_path() -> str:
    """The CBC binary that ships inside pulp (< 4.0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD().path


def _make_solver(solver: str, time_limit: float | None, gap: float | None,
                 warm: bool = False):
    if solver == "cbc":
        # The root LP is usually integral or nearly so. CBC's dual simplex solves it about
        # 3x faster than its default choice here, and its feasibility pump, which only
        # repeats the rounding the root already did, is what CBC spent most of its time
        # on (LLaMA-3-8B on 8x8: 7.4 s -> 3.4 s, same optimum); branching finishes sooner.
        return pulp.COIN_CMD(msg=solver_verbose(), timeLimit=time_limit, gapRel=gap, threads=1,
                             path=_cbc_path(), options=["dualS", "feas off"], warmStart=warm)
    if solver == "highs":
        if "HiGHS" not in pulp.listSolvers(onlyAvailable=True):
            raise ValueError("solver='highs' needs the highspy package: pip install highspy")
        return pulp.HiGHS(msg=solver_verbose(), timeLimit=time_limit, gapRel=gap, threads=1,
                          random_seed=0, warmStart=warm)
    raise ValueError(f"solver must be 'cbc' or 'highs', got {solver!r}")


def _fold_edges(costs: dict[str, np.ndarray], edges: list[Edge]) -> tuple[list[Edge], float]:
    """Fold edges that a single side decides into node costs; merge parallel edges."""
    free: dict[tuple, Edge] = {}
    constant = 0.0
    for e in edges:
        t = e.table
        if not np.isfinite(t).all() or t.size == 0:
            pass
        elif (t == 0).all():
            continue
        if len(costs[e.u]) == 1 and len(costs[e.v]) == 1:
            constant += float(e.table[e.row_of[0], e.col_of[0]])
        elif len(costs[e.u]) == 1:
            costs[e.v] = costs[e.v] + t[e.row_of[0]][e.col_of]
        elif len(costs[e.v]) == 1:
            costs[e.u] = costs[e.u] + t[:, e.col_of[0]][e.row_of]
        elif t.shape[0] == 1 or (np.isfinite(t).all() and (t == t[:1]).all()):
            costs[e.v] = costs[e.v] + t[0][e.col_of]      # the producer's layout is irrelevant
        elif t.shape[1] == 1 or (np.isfinite(t).all() and (t == t[:, :1]).all()):
            costs[e.u] = costs[e.u] + t[:, 0][e.row_of]
        else:
            key = (e.u, e.v, e.row_of.tobytes(), e.col_of.tobytes())
            if key in free:
                free[key] = Edge(e.u, e.v, e.row_of, e.col_of, free[key].table + t)
            else:
                free[key] = e
    return list(free.values()), constant


def solve_ilp(problem: ILPProblem, *, solver: str = "cbc", time_limit: float | None = None,
              gap: float | None = None, initial: dict[str, int] | None = None) -> ILPSolution:
    """Alpa's ILP; ``initial`` (node -> strategy index) is a feasible start for the solver."""
    start = time.perf_counter()
    full_costs = {k: np.asarray(v, dtype=float).copy() for k, v in problem.node_costs.items()}
    full_edges, constant = _fold_edges(full_costs, problem.edges)
    for k, c in full_costs.items():
        if not np.isfinite(c).any():
            raise InfeasibleError(f"node {k!r}: every strategy needs an impossible resharding")
    if not math.isfinite(constant):
        raise InfeasibleError("two fixed layouts cannot be connected")
    protected = set().union(*(g.nodes for g in problem.shared))
    reduced = presolve(full_costs, full_edges, problem.memory_terms, protected=protected)
    costs, edges = reduced.costs, reduced.edges
    allowed = {k: np.isfinite(c) for k, c in costs.items()}
    for k, ok in allowed.items():
        if not ok.any():    # a neighbour solved in closed form left it no way to connect
            raise InfeasibleError(f"node {k!r}: every strategy needs an impossible resharding")
    if initial is not None:
        initial = reduced.start(initial)

    # Scale costs so the largest finite coefficient is ~1e6 (solver tolerances are absolute).
    top = max([np.abs(c[np.isfinite(c)]).max(initial=0) for c in costs.values()] +
              [np.abs(e.table[np.isfinite(e.table)]).max(initial=0) for e in edges] +
              [np.abs(g.table[np.isfinite(g.table)]).max(initial=0) for g in problem.shared] +
              [0.0])
    scale = 1e6 / top if top > 0 else 1.0
    # the same model, written into HiGHS as arrays (no PuLP objects); values whose reads
    # share one resharded copy (``problem.shared``) have extra variables only PuLP writes
    if solver == "highs" and DIRECT_HIGHS and not problem.shared:
        return _finish(problem, reduced, full_costs, full_edges, constant, start,
                       _solve_highs(problem, reduced, costs, edges, scale, time_limit, gap))

    prob = pulp.LpProblem("torchalpa_intra_op", pulp.LpMinimize)
    s: dict[str, list] = {}
    objective = []
    for idx, (k, c) in enumerate(costs.items()):
        if len(c) == 1:
            s[k] = [1]
            continue
        vars_ = []
        for a in range(len(c)):
            if allowed[k][a]:
                var = prob.add_variable(f"s{idx}_{a}", cat="Binary")
                if c[a] != 0:
                    objective.append((var, c[a] * scale))
                vars_.append(var)
            else:
                vars_.append(None)
        prob += pulp.lpSum(x for x in vars_ if x is not None) == 1
        s[k] = vars_
        if initial is not None and k in initial:
            for a, var in enumerate(vars_):
                if var is not None:
                    var.setInitialValue(1 if a == initial[k] else 0)
    for eidx, e in enumerate(edges):
        P, Q = e.table.shape
        rows = [[] for _ in range(P)]
        cols = [[] for _ in range(Q)]
        row_sources = [[] for _ in range(P)]
        col_sources = [[] for _ in range(Q)]
        for a, p in enumerate(e.row_of):
            if s[e.u][a] is not None:
                row_sources[p].append(s[e.u][a])
        for b, q in enumerate(e.col_of):
            if s[e.v][b] is not None:
                col_sources[q].append(s[e.v][b])
        for p in range(P):
            if not row_sources[p]:
                continue
            for q in range(Q):
                if not col_sources[q] or not math.isfinite(e.table[p, q]):
                    continue
                var = prob.add_variable(f"e{eidx}_{p}_{q}", lowBound=0, upBound=1)
                if e.table[p, q] != 0:
                    objective.append((var, e.table[p, q] * scale))
                rows[p].append(var)
                cols[q].append(var)
        for p in range(P):
            if row_sources[p]:
                prob += pulp.lpSum(rows[p]) == pulp.lpSum(row_sources[p])
        for q in range(Q):
            if col_sources[q]:
                prob += pulp.lpSum(cols[q]) == pulp.lpSum(col_sources[q])
    for gidx, group in enumerate(problem.shared):
        objective += add_shared_reads(prob, s, group, f"g{gidx}", scale)
    peak = prob.add_variable("peak_bytes", lowBound=0) if problem.minimize_peak else None
    if problem.memory_budget is not None or peak is not None:
        mem_scale = 1.0 / max(1.0, max((float(np.max(m)) for g in problem.memory_terms
                                        for m in g.values()), default=1.0))
        for group in problem.memory_terms:
            terms, fixed = [], 0.0
            for k, mem in group.items():
                if k not in s:
                    fixed += reduced.fixed_bytes(k, mem) * mem_scale
                elif len(s[k]) == 1:
                    fixed += float(mem[0]) * mem_scale
                else:
                    terms += [(s[k][a], float(mem[a]) * mem_scale) for a in range(len(mem))
                              if s[k][a] is not None and mem[a] != 0]
            if peak is not None:
                prob += pulp.LpAffineExpression(terms + [(peak, -1.0)]) <= -fixed
            else:
                assert problem.memory_budget is not None
                prob += pulp.LpAffineExpression(terms) <= problem.memory_budget * mem_scale - fixed
    prob += pulp.LpAffineExpression([(peak, 1.0)] if peak is not None else objective)
    status = prob.solve(_make_solver(solver, time_limit, gap, warm=initial is not None))
    status_name = pulp.LpStatus[status]
    if status_name in ("Infeasible", "Not Solved", "Undefined") or prob.sol_status in (
            pulp.LpSolutionInfeasible, pulp.LpSolutionNoSolutionFound):
        raise InfeasibleError(f"the ILP has no feasible solution (solver status: {status_name})")
    choice = {}
    for k, vars_ in s.items():
        values = [0.0 if x is None or isinstance(x, int) else (x.value() or 0.0) for x in vars_]
        choice[k] = 0 if len(vars_) == 1 else int(np.argmax(values))
    choice = reduced.complete(choice)
    # the objective of the problem as given, not of its reduced form
    total = constant + sum(full_costs[k][a] for k, a in choice.items())
    for e in full_edges:
        total += e.table[e.row_of[choice[e.u]], e.col_of[choice[e.v]]]
    total += sum(shared_reads_cost(g, choice) for g in problem.shared)
    if not math.isfinite(total):
        raise InfeasibleError("no plan connects every node without an impossible resharding")
    if peak is not None:
        total = float(peak.value() or 0.0) / mem_scale
    return ILPSolution(choice=choice, objective=float(total), status=status_name,
                       seconds=time.perf_counter() - start,
                       num_variables=prob.numVariables(), num_constraints=prob.numConstraints())


def _solve_highs(problem: ILPProblem, reduced, costs, edges, scale: float,
                 time_limit: float | None, gap: float | None):
    from torchalpa.passes.ilp_highs import solve_with_highs
    _make_solver("highs", time_limit, gap)     # the same error when highspy is missing
    return solve_with_highs(costs, edges, reduced, problem.memory_terms, problem.memory_budget,
                            problem.minimize_peak, scale, time_limit=time_limit, gap=gap,
                            verbose=bool(solver_verbose()))


def _finish(problem: ILPProblem, reduced, full_costs, full_edges, constant: float,
            start: float, result) -> ILPSolution:
    """The solution of a solve done by ``passes/ilp_highs.py`` (see the PuLP path above)."""
    if result.status in ("Infeasible", "Not Solved", "Undefined"):
        raise InfeasibleError(f"the ILP has no feasible solution (solver status: "
                              f"{result.status})")
    choice = reduced.complete({k: result.choice.get(k, 0) for k in reduced.costs})
    total = constant + sum(full_costs[k][a] for k, a in choice.items())
    for e in full_edges:
        total += e.table[e.row_of[choice[e.u]], e.col_of[choice[e.v]]]
    if not math.isfinite(total):
        raise InfeasibleError("no plan connects every node without an impossible resharding")
    if problem.minimize_peak:
        mem_scale = 1.0 / max(1.0, max((float(np.max(m)) for g in problem.memory_terms
                                        for m in g.values()), default=1.0))
        total = float(result.peak or 0.0) / mem_scale
    return ILPSolution(choice=choice, objective=float(total), status=result.status,
                       seconds=time.perf_counter() - start,
                       num_variables=result.num_variables,
                       num_constraints=result.num_constraints)
