"""The ILP's linear-relaxation bound: never above any plan's cost, and its offset exact.

``passes/ilp.lower_bound`` lets the planner skip a logical mesh whose best possible plan
cannot beat one it already has; a bound above the true optimum would skip the best mesh
silently, so it is checked against brute force on random problems, including nodes left
with a single strategy (whose cost the linear model leaves out and the bound adds back).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_presolve import brute_force, random_problem

from torchalpa.passes.sharding.ilp import ILPProblem, InfeasibleError, lower_bound, solve_ilp


def _with_fixed_nodes(problem: ILPProblem, rng: np.random.Generator) -> ILPProblem:
    """``problem`` with every third node given one strategy of a non-zero cost (edges to it
    keep their first column or row)."""
    costs = dict(problem.node_costs)
    for k in list(costs)[::3]:
        costs[k] = np.array([float(rng.integers(1, 5))])
    edges = []
    for e in problem.edges:
        row_of = e.row_of[:1] if len(costs[e.u]) == 1 else e.row_of
        col_of = e.col_of[:1] if len(costs[e.v]) == 1 else e.col_of
        edges.append(type(e)(e.u, e.v, row_of, col_of, e.table))
    return ILPProblem(node_costs=costs, edges=edges, memory_terms=[], memory_budget=None)


@pytest.mark.parametrize("memory,fixed", [(False, False), (True, False), (False, True)])
def test_the_bound_is_at_most_the_optimum_and_the_integral_bound_is_it(memory, fixed):
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(40):
        problem = random_problem(rng, memory)
        if fixed:
            problem = _with_fixed_nodes(problem, rng)
        expected = brute_force(problem)
        if not np.isfinite(expected):
            continue
        bound = lower_bound(problem)
        exact = lower_bound(problem, integral=True)
        assert bound is not None and exact is not None
        assert bound <= expected + 1e-6
        # the same offsets with integral columns give the optimum itself: nothing left out
        assert exact == pytest.approx(expected, abs=1e-6)
        assert exact == pytest.approx(solve_ilp(problem, solver="highs").objective, abs=1e-6)
        checked += 1
    assert checked > 20


def test_the_relaxation_is_weaker_where_layouts_conflict_in_a_cycle():
    """Four nodes, each meeting the three others, two layouts each, an edge paying 1 where
    both ends pick the same layout: any plan pays at least 2 (two colours on four nodes),
    the relaxation splits every node half and half and pays 0. The bound is a bound, not
    the optimum (and nothing is presolved away: every node meets three others)."""
    from torchalpa.passes.sharding.ilp import Edge
    names = ["a", "b", "c", "d"]
    same = np.eye(2)
    edges = [Edge(u, v, np.arange(2), np.arange(2), same)
             for i, u in enumerate(names) for v in names[i + 1:]]
    problem = ILPProblem(node_costs={k: np.zeros(2) for k in names}, edges=edges)
    assert solve_ilp(problem, solver="highs").objective == pytest.approx(2.0)
    assert lower_bound(problem, integral=True) == pytest.approx(2.0)
    assert lower_bound(problem) == pytest.approx(0.0, abs=1e-9)


def test_an_infeasible_relaxation_is_reported():
    from torchalpa.passes.sharding.ilp import Edge
    # two nodes whose every pair of layouts is forbidden
    problem = ILPProblem(node_costs={"a": np.zeros(2), "b": np.zeros(2)},
                         edges=[Edge("a", "b", np.array([0, 1]), np.array([0, 1]),
                                     np.full((2, 2), np.inf))])
    with pytest.raises(InfeasibleError):
        lower_bound(problem)


def test_no_bound_when_minimizing_memory():
    problem = ILPProblem(node_costs={"a": np.zeros(2)}, minimize_peak=True,
                         memory_terms=[{"a": np.array([1.0, 2.0])}])
    assert lower_bound(problem) is None
