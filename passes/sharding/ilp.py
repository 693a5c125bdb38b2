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
``passes/sharding/presolve.py`` removes dominated strategies and solves simple nodes in closed form
(both exact) before the rest goes to the solver. The rest is written once as arrays
(``passes/sharding/ilp_model.py``) and solved by CBC (through PuLP, by default) or HiGHS (the
arrays directly, ``passes/sharding/ilp_highs.py``); single-threaded, so the same input gives the
same answer.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pulp

from torchalpa.core.progress import solver_verbose
from torchalpa.core.switches import PassSwitches
from torchalpa.passes.sharding.ilp_model import BuiltModel, LinearModel, build_model
from torchalpa.passes.sharding.presolve import Presolved, presolve
from torchalpa.passes.sharding.shared_reshard import SharedReads, shared_reads_cost

__all__ = ["Edge", "ILPProblem", "ILPSolution", "solve_ilp", "lower_bound", "InfeasibleError",
           "SolverStopped", "MemoryNotSettled",
           "clock_watch", "clock_stops_elsewhere", "CLOCK_NOTE", "OverMemoryBudget"]

CLOCK_NOTE = "the solver's time limit (a safety net) stopped"
"""How a plan's note begins when a solver's time limit, not its node limit, ended one of
its solves: such a plan depends on the machine's speed and is not cached."""

_clock_stops: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar(
    "torchalpa_clock_stops", default=None)


@contextlib.contextmanager
def clock_watch():
    """``with clock_watch() as stops:`` -- ``stops`` lists the time limit of each solver
    run within that a time limit stopped (an enclosing watch sees them too)."""
    outer = _clock_stops.get()
    stops: list[float] = []
    token = _clock_stops.set(stops)
    try:
        yield stops
    finally:
        _clock_stops.reset(token)
        if outer is not None:
            outer.extend(stops)


def clock_stops_elsewhere(stops: list[float]) -> None:
    """Count ``stops`` -- time limits that stopped solver runs in another process (a
    forked worker, which sent them back) -- in the watches open here."""
    here = _clock_stops.get()
    if here is not None:
        here.extend(stops)


class InfeasibleError(ValueError):
    """No choice of strategies satisfies the constraints."""


class OverMemoryBudget(InfeasibleError):
    """No plan of a view fits its memory budget (by the step's bound, the view's memory
    floor or its ILPs), as opposed to no strategy at all or a solver stopped: what the
    advice of what would fit answers. Its message only, so it crosses from forked
    workers."""


class SolverStopped(InfeasibleError):
    """The solver stopped (its time limit) before it found any plan: not a proof that
    none exists."""


class MemoryNotSettled(InfeasibleError):
    """Rounds of memory rows ended with every plan found over the budget, without the
    solver proving that none fits: not a proof either (a caller reusing "does not fit" as
    a fact, like the pipeline search's stages, must not take it as one)."""


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
    memory_kept: list[list] = field(default_factory=list)
    """Per group of ``memory_terms`` (same order), the ZeRO-2 copies that may be alive
    there (``passes/pricing/memory.py::KeptTerm``), whose bytes depend on three choices;
    empty lists (or none at all) when nothing is kept."""
    memory_budget: float | None = None
    minimize_peak: bool = False
    """Ignore costs; find the layouts with the smallest largest memory group."""
    shared: list[SharedReads] = field(default_factory=list)
    """Values whose reads pay once per target layout (``passes/sharding/shared_reshard.py``); their
    nodes are left out of presolve's rewrites, which assume additive edge costs."""


@dataclass
class ILPSolution:
    choice: dict[str, int]
    objective: float
    status: str
    seconds: float
    num_variables: int = 0
    num_constraints: int = 0
    clock_stopped: bool = False
    """The solver's time limit (a safety net) stopped it: a faster or idler machine may
    find a better plan. Its node limit (``max_nodes``) stops at the same plan anywhere."""


def _cbc_path() -> str:
    """The CBC binary that ships inside pulp (< 4.0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD().path


def resolve_solver(solver: str) -> str:
    """The solver ``'auto'`` means here: HiGHS when highspy imports, else CBC."""
    if solver != "auto":
        return solver
    return "highs" if importlib.util.find_spec("highspy") is not None else "cbc"


def _make_solver(solver: str, time_limit: float | None, gap: float | None,
                 warm: bool = False, max_nodes: int | None = None):
    if solver == "cbc":
        # The root LP is usually integral or nearly so. CBC's dual simplex solves it about
        # 3x faster than its default choice here, and its feasibility pump, which only
        # repeats the rounding the root already did, is what CBC spent most of its time
        # on (LLaMA-3-8B on 8x8: 7.4 s -> 3.4 s, same optimum); branching finishes sooner.
        return pulp.COIN_CMD(msg=solver_verbose(), timeLimit=time_limit, gapRel=gap, threads=1,
                             path=_cbc_path(), options=["dualS", "feas off"], warmStart=warm,
                             maxNodes=max_nodes)
    if solver == "highs":
        if "HiGHS" not in pulp.listSolvers(onlyAvailable=True):
            raise ValueError("solver='highs' needs the highspy package: pip install highspy")
        if max_nodes is None:
            return pulp.HiGHS(msg=solver_verbose(), timeLimit=time_limit, gapRel=gap,
                              threads=1, random_seed=0, warmStart=warm)
        return _NodeLimitedHiGHS(msg=solver_verbose(), timeLimit=time_limit, gapRel=gap,
                                 threads=1, random_seed=0, warmStart=warm,
                                 mip_max_nodes=int(max_nodes))
    raise ValueError(f"solver must be 'cbc' or 'highs', got {solver!r}")


class _NodeLimitedHiGHS(pulp.HiGHS):
    """PuLP's HiGHS with a node limit: a search its limit stopped (HiGHS'
    ``kSolutionLimit``, missing from PuLP's status table, where it raised ``KeyError``)
    keeps its incumbent as the direct path does (``ilp_highs``) -- a stop by work, the same
    plan at any load -- or reports no plan where it had none."""

    def findSolutionValues(self, lp):
        import highspy
        model = lp.solverModel
        if model.getModelStatus() != highspy.HighsModelStatus.kSolutionLimit:
            return super().findSolutionValues(lp)
        if not math.isfinite(model.getObjectiveValue()) or \
                model.getInfo().primal_solution_status != 2:     # 2: a feasible point
            return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
        values = model.getSolution().col_value
        for var in lp.variables():
            var.varValue = values[var.index]
        return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible


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


class _Prepared(NamedTuple):
    """A problem reduced and written for the solver, with what reads a solution back."""
    full_costs: dict[str, np.ndarray]
    full_edges: list[Edge]
    constant: float
    reduced: Presolved
    built: BuiltModel
    scale: float


def _prepare(problem: ILPProblem, initial: dict[str, int] | None) -> _Prepared:
    """Fold edges, presolve and write ``problem`` as a linear model (costs scaled so the
    largest finite coefficient is about 1e6: solver tolerances are absolute)."""
    full_costs = {k: np.asarray(v, dtype=float).copy() for k, v in problem.node_costs.items()}
    full_edges, constant = _fold_edges(full_costs, problem.edges)
    for k, c in full_costs.items():
        if not np.isfinite(c).any():
            raise InfeasibleError(f"node {k!r}: every strategy needs an impossible resharding")
    if not math.isfinite(constant):
        raise InfeasibleError("two fixed layouts cannot be connected")
    protected = set().union(*(g.nodes for g in problem.shared),
                            *(t.nodes for terms in problem.memory_kept for t in terms))
    reduced = presolve(full_costs, full_edges, problem.memory_terms, protected=protected)
    costs, edges = reduced.costs, reduced.edges
    for k, c in costs.items():
        if not np.isfinite(c).any():   # a neighbour solved in closed form left it no way to connect
            raise InfeasibleError(f"node {k!r}: every strategy needs an impossible resharding")
    if initial is not None:
        initial = reduced.start(initial)
    top = max([np.abs(c[np.isfinite(c)]).max(initial=0) for c in costs.values()] +
              [np.abs(e.table[np.isfinite(e.table)]).max(initial=0) for e in edges] +
              [np.abs(g.table[np.isfinite(g.table)]).max(initial=0) for g in problem.shared] +
              [0.0])
    scale = 1e6 / top if top > 0 else 1.0
    built = build_model(costs, edges, problem.shared, reduced, problem.memory_terms,
                        problem.memory_budget, problem.minimize_peak, scale, initial,
                        kept=problem.memory_kept)
    return _Prepared(full_costs, full_edges, constant, reduced, built, scale)


def solve_ilp(problem: ILPProblem, *, solver: str = "auto", time_limit: float | None = None,
              gap: float | None = None, initial: dict[str, int] | None = None,
              max_nodes: int | None = None) -> ILPSolution:
    """Alpa's ILP; ``initial`` (node -> strategy index) is a feasible start for the solver.
    ``max_nodes`` bounds the branch-and-bound by work (the same plan at any load);
    ``time_limit`` is a safety net (``ILPSolution.clock_stopped`` says when it fired)."""
    start = time.perf_counter()
    solver = resolve_solver(solver)
    full_costs, full_edges, constant, reduced, built, _ = _prepare(problem, initial)
    if solver == "highs" and PassSwitches.current().direct_highs:
        run = _solve_with_highs(built.model, time_limit, gap, max_nodes)
    else:
        run = _solve_with_pulp(built.model, _make_solver(solver, time_limit, gap,
                                                         warm=initial is not None,
                                                         max_nodes=max_nodes), time_limit)
    stops = _clock_stops.get()
    if run.clock_stopped and stops is not None:
        stops.append(float(time_limit or 0.0))
    if not run.solved:
        if run.status == "Not Solved":
            raise SolverStopped(f"the ILP solver stopped before it found a plan (time limit "
                                f"{time_limit} s, node limit {max_nodes}); a longer "
                                f"time_limit or a larger max_nodes may find one")
        raise InfeasibleError(f"the ILP has no feasible solution (solver status: {run.status})")
    choice = reduced.complete(built.choice(run.values))
    # the objective of the problem as given, not of its reduced form
    total = constant + sum(full_costs[k][a] for k, a in choice.items())
    for e in full_edges:
        total += e.table[e.row_of[choice[e.u]], e.col_of[choice[e.v]]]
    total += sum(shared_reads_cost(g, choice) for g in problem.shared)
    if not math.isfinite(total):
        raise InfeasibleError("no plan connects every node without an impossible resharding")
    if built.peak is not None:
        total = float(run.values[built.peak]) / built.mem_scale
    return ILPSolution(choice=choice, objective=float(total), status=run.status,
                       seconds=time.perf_counter() - start,
                       num_variables=run.num_variables, num_constraints=run.num_constraints,
                       clock_stopped=run.clock_stopped)


def lower_bound(problem: ILPProblem, *, integral: bool = False) -> float | None:
    """A number no plan of ``problem`` costs less than: the optimum of its linear
    relaxation (every one-hot strategy vector allowed to be fractional), in the objective's
    own units. A few LP iterations where the ILP may branch for minutes, so a caller can
    skip a problem whose bound already exceeds a plan it has. ``integral=True`` solves the
    ILP itself the same way (the bound is then its optimum: what tests compare with
    ``solve_ilp``). None when HiGHS is not installed or the problem minimizes memory.

    The linear model holds the reduced problem's costs, scaled; what it leaves out is
    constant: the edges between fixed layouts, the nodes the presolve solved with no
    neighbour left, and the cost of every node left with one strategy, added back here."""
    if problem.minimize_peak or importlib.util.find_spec("highspy") is None:
        return None
    from torchalpa.passes.sharding.ilp_highs import linear_optimum
    prepared = _prepare(problem, None)
    optimum = linear_optimum(prepared.built.model, integral=integral)
    fixed = sum(float(c[0]) for c in prepared.reduced.costs.values() if len(c) == 1)
    bound = None if optimum is None else \
        optimum / prepared.scale + prepared.constant + prepared.reduced.constant + fixed
    if bound is None or not math.isfinite(bound):
        raise InfeasibleError("the ILP's relaxation has no feasible solution")
    return bound


class _SolverRun(NamedTuple):
    status: str
    """PuLP's status name."""
    solved: bool
    values: np.ndarray
    """Column values in the model's order."""
    num_variables: int
    num_constraints: int
    clock_stopped: bool = False
    """The time limit, not optimality or the node limit, ended the run."""


def _solve_with_highs(model: LinearModel, time_limit: float | None, gap: float | None,
                      max_nodes: int | None = None) -> _SolverRun:
    """Hand ``model``'s arrays straight to HiGHS (``passes/sharding/ilp_highs.py``)."""
    from torchalpa.passes.sharding.ilp_highs import solve_with_highs
    _make_solver("highs", time_limit, gap)     # the same error when highspy is missing
    status, values, clock = solve_with_highs(model, time_limit=time_limit, gap=gap,
                                             verbose=bool(solver_verbose()),
                                             max_nodes=max_nodes)
    return _SolverRun(status, status not in ("Infeasible", "Not Solved", "Undefined"), values,
                      len(model.names), len(model.row_lower), clock)


def _solve_with_pulp(model: LinearModel, solver, time_limit: float | None = None
                     ) -> _SolverRun:
    """Write ``model`` through PuLP (which hands CBC an MPS file) and solve it with
    ``solver``, a PuLP solver object."""
    prob = pulp.LpProblem("torchalpa_intra_op", pulp.LpMinimize)
    columns = [prob.add_variable(name, lowBound=0,
                                 upBound=upper if math.isfinite(upper) else None,
                                 cat=pulp.LpBinary if integer else pulp.LpContinuous)
               for name, upper, integer in zip(model.names, model.upper, model.integer)]
    for lower, upper, index, value in model.rows():
        expression = pulp.LpAffineExpression([(columns[c], v) for c, v in zip(index, value)])
        if lower == upper:
            prob += pulp.LpConstraint(expression, pulp.LpConstraintEQ, rhs=lower)
        elif math.isinf(lower):
            prob += pulp.LpConstraint(expression, pulp.LpConstraintLE, rhs=upper)
        else:
            assert math.isinf(upper), "a row with two finite bounds"
            prob += pulp.LpConstraint(expression, pulp.LpConstraintGE, rhs=lower)
    prob += pulp.LpAffineExpression([(x, c) for x, c in zip(columns, model.cost) if c != 0])
    for col, value in model.initial.items():
        columns[col].setInitialValue(value)
    start = time.perf_counter()
    status = pulp.LpStatus[prob.solve(solver)]
    # PuLP does not say why CBC stopped; a run that reached its time limit was stopped by it
    clock = time_limit is not None and time.perf_counter() - start >= 0.99 * time_limit
    solved = status not in ("Infeasible", "Not Solved", "Undefined") and prob.sol_status not in (
        pulp.LpSolutionInfeasible, pulp.LpSolutionNoSolutionFound)
    values = np.array([x.value() or 0.0 for x in columns], dtype=float)
    return _SolverRun(status, solved, values, prob.numVariables(), prob.numConstraints(), clock)
