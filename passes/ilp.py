"""Alpa's intra-op ILP: pick one strategy per node, minimizing node plus edge costs.

For node ``i`` a one-hot vector ``s_i`` over its strategies; for each edge ``(i, j)`` a
vector ``e_ij`` over strategy pairs, linearized as in Alpa:
``sum_b e_ij[a, b] = s_i[a]`` and ``sum_a e_ij[a, b] = s_j[b]`` (so ``e_ij`` is the outer
product of the one-hots, and may be continuous). Objective: ``sum c_i . s_i +
sum R_ij . e_ij``. An infinite entry forbids that pair. Optional memory constraints:
``sum_i m_i . s_i <= budget`` for each group of nodes alive together.

Nodes with a single strategy are constants and edges touching them fold into the other
end, which keeps the problem small. Solved with pulp: CBC by default, HiGHS on request;
single-threaded, so the same input gives the same answer.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import pulp

__all__ = ["ILPProblem", "ILPSolution", "solve_ilp", "InfeasibleError"]


class InfeasibleError(ValueError):
    """No choice of strategies satisfies the constraints."""


@dataclass
class ILPProblem:
    node_costs: dict[str, np.ndarray]
    edge_costs: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    memory_terms: list[dict[str, np.ndarray]] = field(default_factory=list)
    memory_budget: float | None = None


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


def _make_solver(solver: str, time_limit: float | None, gap: float | None):
    if solver == "cbc":
        return pulp.COIN_CMD(msg=False, timeLimit=time_limit, gapRel=gap, threads=1,
                             path=_cbc_path())
    if solver == "highs":
        if "HiGHS" not in pulp.listSolvers(onlyAvailable=True):
            raise ValueError("solver='highs' needs the highspy package: pip install highspy")
        return pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=gap, threads=1,
                          random_seed=0)
    raise ValueError(f"solver must be 'cbc' or 'highs', got {solver!r}")


def solve_ilp(problem: ILPProblem, *, solver: str = "cbc", time_limit: float | None = None,
              gap: float | None = None) -> ILPSolution:
    start = time.perf_counter()
    costs = {k: np.asarray(v, dtype=float).copy() for k, v in problem.node_costs.items()}
    allowed = {k: np.isfinite(v) for k, v in costs.items()}
    constant = 0.0

    # Fold edges with a single-strategy end into the other end's node costs.
    free_edges: dict[tuple[str, str], np.ndarray] = {}
    for (u, v), m in problem.edge_costs.items():
        m = np.asarray(m, dtype=float)
        if m.shape != (len(costs[u]), len(costs[v])):
            raise ValueError(f"edge {u}->{v}: cost matrix {m.shape} does not match "
                             f"strategies ({len(costs[u])}, {len(costs[v])})")
        if len(costs[u]) == 1 and len(costs[v]) == 1:
            constant += m[0, 0]
        elif len(costs[u]) == 1:
            costs[v] = costs[v] + m[0, :]
        elif len(costs[v]) == 1:
            costs[u] = costs[u] + m[:, 0]
        else:
            key = (u, v)
            free_edges[key] = free_edges[key] + m if key in free_edges else m
    for k, c in costs.items():
        allowed[k] = np.isfinite(c)
        if not allowed[k].any():
            raise InfeasibleError(f"node {k!r}: every strategy needs an impossible resharding")
    if not math.isfinite(constant):
        raise InfeasibleError("two fixed layouts cannot be connected")

    # Scale costs so the largest finite coefficient is ~1e6 (solver tolerances are absolute).
    finite = [np.abs(c[np.isfinite(c)]).max(initial=0) for c in costs.values()]
    finite += [np.abs(m[np.isfinite(m)]).max(initial=0) for m in free_edges.values()]
    top = max(finite, default=0.0)
    scale = 1e6 / top if top > 0 else 1.0

    prob = pulp.LpProblem("torchalpa_intra_op", pulp.LpMinimize)
    s: dict[str, list] = {}
    objective = []
    num_vars = 0
    for idx, (k, c) in enumerate(costs.items()):
        if len(c) == 1:
            s[k] = [1]
            constant += c[0]
            continue
        vars_ = []
        for a in range(len(c)):
            if allowed[k][a]:
                var = prob.add_variable(f"s{idx}_{a}", cat="Binary")
                num_vars += 1
                if c[a] != 0:
                    objective.append(c[a] * scale * var)
                vars_.append(var)
            else:
                vars_.append(0)
        prob += pulp.lpSum(x for x in vars_ if not isinstance(x, int)) == 1
        s[k] = vars_
    for eidx, ((u, v), m) in enumerate(free_edges.items()):
        rows = [[] for _ in range(m.shape[0])]
        cols = [[] for _ in range(m.shape[1])]
        for a in range(m.shape[0]):
            if isinstance(s[u][a], int):
                continue
            for b in range(m.shape[1]):
                if isinstance(s[v][b], int) or not math.isfinite(m[a, b]):
                    continue
                e = prob.add_variable(f"e{eidx}_{a}_{b}", lowBound=0, upBound=1)
                num_vars += 1
                if m[a, b] != 0:
                    objective.append(m[a, b] * scale * e)
                rows[a].append(e)
                cols[b].append(e)
        for a, row in enumerate(rows):
            if not isinstance(s[u][a], int):
                prob += pulp.lpSum(row) == s[u][a]
        for b, col in enumerate(cols):
            if not isinstance(s[v][b], int):
                prob += pulp.lpSum(col) == s[v][b]
    if problem.memory_budget is not None:
        for group in problem.memory_terms:
            terms, fixed = [], 0.0
            for k, mem in group.items():
                if len(s[k]) == 1:
                    fixed += float(mem[0])
                else:
                    terms += [float(mem[a]) * s[k][a] for a in range(len(mem))
                              if not isinstance(s[k][a], int)]
            prob += pulp.lpSum(terms) <= problem.memory_budget - fixed
    prob += pulp.lpSum(objective) if objective else pulp.lpSum([])
    status = prob.solve(_make_solver(solver, time_limit, gap))
    status_name = pulp.LpStatus[status]
    if status_name in ("Infeasible", "Not Solved", "Undefined") or prob.sol_status in (
            pulp.LpSolutionInfeasible, pulp.LpSolutionNoSolutionFound):
        raise InfeasibleError(f"the ILP has no feasible solution (solver status: {status_name})")
    choice = {}
    for k, vars_ in s.items():
        if len(vars_) == 1:
            choice[k] = 0
            continue
        values = [0.0 if isinstance(x, int) else (x.value() or 0.0) for x in vars_]
        choice[k] = int(np.argmax(values))
    total = constant + sum(costs[k][a] for k, a in choice.items() if len(costs[k]) > 1)
    for (u, v), m in free_edges.items():
        total += m[choice[u], choice[v]]
    return ILPSolution(choice=choice, objective=float(total), status=status_name,
                       seconds=time.perf_counter() - start, num_variables=num_vars,
                       num_constraints=prob.numConstraints())
