"""The ILP presolve: exact reductions, checked against enumerating every plan."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from torchalpa.passes.sharding.ilp import Edge, ILPProblem, InfeasibleError, solve_ilp
from torchalpa.passes.sharding.presolve import presolve


def brute_force(problem: ILPProblem) -> float:
    """The best objective over every combination of strategies (inf if none fits)."""
    names = list(problem.node_costs)
    best = np.inf
    for pick in itertools.product(*(range(len(problem.node_costs[k])) for k in names)):
        choice = dict(zip(names, pick))
        if problem.memory_budget is not None and any(
                sum(m[choice[k]] for k, m in group.items()) > problem.memory_budget + 1e-9
                for group in problem.memory_terms):
            continue
        total = sum(problem.node_costs[k][choice[k]] for k in names)
        total += sum(e.dense()[choice[e.u], choice[e.v]] for e in problem.edges)
        best = min(best, total)
    return best


def objective_of(problem: ILPProblem, choice: dict[str, int]) -> float:
    return (sum(problem.node_costs[k][a] for k, a in choice.items())
            + sum(e.dense()[choice[e.u], choice[e.v]] for e in problem.edges))


def random_problem(rng: np.random.Generator, memory: bool) -> ILPProblem:
    """A small graph with repeated layouts, forbidden pairs, ties and memory groups."""
    names = [f"n{i}" for i in range(int(rng.integers(4, 7)))]
    sizes = {k: int(rng.integers(2, 5)) for k in names}
    costs = {k: rng.integers(0, 4, size=n).astype(float) for k, n in sizes.items()}
    edges = []
    for _ in range(int(rng.integers(3, 8))):
        u, v = rng.choice(len(names), size=2, replace=False)
        u, v = names[min(u, v)], names[max(u, v)]
        row_of = rng.integers(0, 3, size=sizes[u])
        col_of = rng.integers(0, 3, size=sizes[v])
        table = rng.integers(0, 5, size=(3, 3)).astype(float)
        table[rng.random((3, 3)) < 0.15] = np.inf
        edges.append(Edge(u, v, row_of, col_of, table))
    groups, budget = [], None
    if memory:
        held = {k: rng.integers(1, 6, size=n).astype(float) for k, n in sizes.items()
                if rng.random() < 0.5}
        groups = [{k: m for k, m in held.items() if rng.random() < 0.7} for _ in range(2)]
        budget = float(rng.integers(4, 14))
    return ILPProblem(node_costs=costs, edges=edges, memory_terms=groups,
                      memory_budget=budget)


# The presolve is the same whichever solver finishes the reduced problem. HiGHS runs in
# this process (a few ms a problem); CBC, the default, is a process of its own per solve
# (about 0.2 s on 2 loaded cores, 11 s of make test for 60 problems), so without memory
# terms it solves every CBC_EVERY-th problem, and both must reach the brute-force optimum.
CBC_EVERY = 6


@pytest.mark.parametrize("memory", [False, True])
def test_presolved_solutions_are_optimal_for_the_original_problem(memory):
    rng = np.random.default_rng(0)
    reductions = solved = by_cbc = 0
    for i in range(60):
        problem = random_problem(rng, memory)
        expected = brute_force(problem)
        reduced = presolve(problem.node_costs, problem.edges, problem.memory_terms)
        reductions += len(reduced.eliminated) + sum(len(d) for d in reduced.dominated_by.values())
        solvers = ["highs", "cbc"] if i % CBC_EVERY == 0 else ["highs"]
        for solver in solvers:
            if not np.isfinite(expected):
                with pytest.raises(InfeasibleError):
                    solve_ilp(problem, solver=solver)
                continue
            solution = solve_ilp(problem, solver=solver)
            assert solution.objective == pytest.approx(expected, abs=1e-6), solver
            # the returned choice is a whole plan of the original problem, with that cost
            assert set(solution.choice) == set(problem.node_costs)
            assert objective_of(problem, solution.choice) == pytest.approx(expected, abs=1e-6)
        solved += np.isfinite(expected)
        by_cbc += np.isfinite(expected) and "cbc" in solvers
    assert solved > 30 and reductions > 50      # the cases exercised the rewrites
    assert by_cbc >= 5


def test_direct_highs_refuses_a_budget_broken_by_nodes_the_presolve_decided():
    """The 28th random problem with memory terms (seed 0): the presolve decides every node,
    and the plan left holds 5 units under a budget of 4. CBC and PuLP's HiGHS call it
    infeasible, and so does the direct HiGHS path (it returned that plan as optimal)."""
    rng = np.random.default_rng(0)
    for _ in range(28):
        problem = random_problem(rng, True)
    assert brute_force(problem) == np.inf
    with pytest.raises(InfeasibleError):
        solve_ilp(problem, solver="cbc")
    with pytest.raises(InfeasibleError):
        solve_ilp(problem, solver="highs")


def chain():
    inf = np.inf
    a = Edge("x", "v", np.arange(2), np.arange(3), np.array([[0., 5., inf], [5., 0., 1.]]))
    b = Edge("v", "y", np.arange(3), np.arange(2), np.array([[0., 4.], [4., 0.], [2., 2.]]))
    costs = {"x": np.array([0., 1.]), "v": np.array([1., 1., 0.]), "y": np.array([3., 0.])}
    return costs, [a, b]


def test_a_chain_node_is_solved_in_closed_form():
    """x - v - y: v holds no memory and meets two nodes, so it leaves the ILP."""
    costs, edges = chain()
    memory = [{"x": np.array([1., 2.]), "y": np.array([2., 1.])}]   # x and y must stay
    reduced = presolve(costs, edges, memory)
    assert [e.node for e in reduced.eliminated] == ["v"] and set(reduced.costs) == {"x", "y"}
    (edge,) = reduced.edges
    # best v between x and y: x=0,y=0 -> v0 (0+1+0); x=1,y=1 -> v1 (0+1+0); x=1,y=0 -> v2
    assert edge.table.tolist() == [[1., 5.], [3., 1.]]
    problem = ILPProblem(node_costs=costs, edges=edges, memory_terms=memory, memory_budget=3)
    solution = solve_ilp(problem)
    assert solution.choice == {"x": 1, "v": 1, "y": 1}
    assert solution.objective == pytest.approx(brute_force(problem)) == 2.0


def test_a_tree_without_memory_is_solved_entirely_in_closed_form():
    costs, edges = chain()
    reduced = presolve(costs, edges, [])
    assert not reduced.costs and len(reduced.eliminated) == 3
    problem = ILPProblem(node_costs=costs, edges=edges)
    assert solve_ilp(problem).objective == brute_force(problem) == 2.0


def test_infeasibility_found_by_elimination_is_reported():
    e = Edge("x", "v", np.arange(2), np.arange(2), np.array([[np.inf, 0.], [np.inf, np.inf]]))
    f = Edge("v", "y", np.arange(2), np.arange(2), np.array([[0., 0.], [np.inf, np.inf]]))
    problem = ILPProblem(node_costs={k: np.zeros(2) for k in "xvy"}, edges=[e, f])
    with pytest.raises(InfeasibleError):
        solve_ilp(problem)


def test_dominated_strategies_go_and_warm_starts_follow_them():
    """u's strategy 1 costs more than 0 and is no better on the edge or in memory."""
    e = Edge("u", "w", np.array([0, 0, 1]), np.arange(2), np.array([[0., 3.], [1., 0.]]))
    costs = {"u": np.array([1., 2., 1.]), "w": np.array([0., 0.])}
    memory = [{"u": np.array([4., 4., 9.]), "w": np.array([1., 2.])}]
    reduced = presolve(costs, [e], memory)
    assert reduced.dominated_by == {"u": {1: 0}}
    assert not np.isfinite(reduced.costs["u"][1]) and np.isfinite(reduced.costs["u"][2])
    assert reduced.start({"u": 1, "w": 0}) == {"u": 0, "w": 0}
    # memory keeps strategy 2 (more bytes, cheaper edge) and w in the problem
    problem = ILPProblem(node_costs=costs, edges=[e], memory_terms=memory, memory_budget=10)
    assert solve_ilp(problem, initial={"u": 1, "w": 0}).objective == brute_force(problem)


def _dominators_one_row_at_a_time(profile):
    """The reference: every row visited in order (main's loop before ``_dominators``)."""
    from torchalpa.passes.sharding.presolve import _no_worse
    n = len(profile)
    keep, order, out = np.ones(n, dtype=bool), np.arange(n), []
    no_worse_than = _no_worse(profile)
    for i in range(n):
        no_worse = no_worse_than[i]
        equal = no_worse & no_worse_than[:, i]
        by = np.flatnonzero(no_worse & keep & (order != i) & ((order < i) | ~equal))
        if len(by):
            keep[i] = False
            out.append((i, int(by[0])))
    return out


def test_dominators_found_at_once_as_one_row_at_a_time():
    """``_dominators`` (candidates found for all rows at once) removes the same rows and
    maps each to the same row as a loop over every row, on random profiles full of ties
    and of chains (a row dominated only by one that goes itself)."""
    from torchalpa.passes.sharding.presolve import _dominators
    rng = np.random.default_rng(0)
    removed = 0
    for _ in range(500):
        n, width = int(rng.integers(1, 12)), int(rng.integers(1, 5))
        profile = rng.integers(0, 3, (n, width)).astype(float)
        profile[rng.random((n, width)) < 0.05] = np.inf
        expected = _dominators_one_row_at_a_time(profile)
        assert _dominators(profile) == expected
        removed += len(expected)
    assert removed > 1000


def _eliminate_rebuilding_the_list(p, memory, protected):
    """The reference: main's ``_eliminate`` before this rewrite, ``p.edges`` filtered after
    every node it removes."""
    from dataclasses import replace

    from torchalpa.passes.sharding.presolve import _Eliminated, _incident, _memory_free
    count, at = 0, _incident(p.edges)
    for k in list(p.costs):
        c = p.costs[k]
        if len(c) < 2 or k in protected or not _memory_free(k, c, memory):
            continue
        edges = at.get(k, [])
        others = [e.u if e.v == k else e.v for e in edges]
        if len(edges) > 2 or (len(others) == 2 and others[0] == others[1]):
            continue
        tables = [e.table[:, e.col_of] if e.v == k else e.table[e.row_of, :].T for e in edges]
        maps = tuple(e.row_of if e.v == k else e.col_of for e in edges)
        total = c if not tables else tables[0] + c if len(tables) == 1 else \
            tables[0][:, None, :] + tables[1][None, :, :] + c
        best = total.min(axis=-1)
        p.eliminated.append(_Eliminated(k, tuple(others), maps, total))
        p.left[k] = np.isfinite(c)
        del p.costs[k]
        for e in edges:
            for n in (e.u, e.v):
                at[n] = [x for x in at[n] if x is not e]
        p.edges = [e for e in p.edges if e.u != k and e.v != k]
        if not others:
            p.constant += float(best)
        elif len(others) == 1:
            p.costs[others[0]] = p.costs[others[0]] + best[maps[0]]
        else:
            new = replace(edges[0], u=others[0], v=others[1], row_of=maps[0],
                          col_of=maps[1], table=best)
            p.edges.append(new)
            at[others[0]].append(new)
            at[others[1]].append(new)
        count += 1
    return count


def _as_seen_from_whole_table(e, k, allowed, idx):
    """The reference: main's ``_as_seen_from`` (the whole table per strategy, then the
    live layouts by ``np.unique``, then ``idx``), as the profile's block."""
    if e.v == k:
        other, table, other_of = e.u, e.table[:, e.col_of], e.row_of
    else:
        other, table, other_of = e.v, e.table[e.row_of, :].T, e.col_of
    return table[np.unique(other_of[allowed[other]])][:, idx].T


def _presolved_arrays(p):
    """Everything ``presolve`` returns, as comparable values."""
    return ([(e.u, e.v, e.row_of.tolist(), e.col_of.tolist(), e.table.tolist())
             for e in p.edges], {k: c.tolist() for k, c in p.costs.items()},
            [(x.node, x.neighbours, [m.tolist() for m in x.maps], x.total.tolist())
             for x in p.eliminated], p.dominated_by, p.constant,
            {k: v.tolist() for k, v in p.left.items()})


def test_eliminations_and_dominance_as_main_made_them(monkeypatch):
    """``_eliminate`` (the edges dropped once at the end) and ``_as_seen_from`` (only the
    cells compared, layouts counted) reduce random problems -- chains and pairs to
    eliminate, parallel edges, self-loops, forbidden pairs, ties -- to the same edges in
    the same order, the same costs, eliminations, dominance and constant as main's."""
    from torchalpa.passes.sharding import presolve as module
    rng = np.random.default_rng(1)
    eliminated = dominated = 0
    for trial in range(300):
        problem = random_problem(rng, memory=trial % 3 == 0)
        if trial % 4 == 0:            # a self-loop and a parallel edge
            u, v = problem.edges[0].u, problem.edges[0].v
            n = len(problem.node_costs[u])
            problem.edges.append(Edge(u, u, np.arange(n), np.arange(n), np.ones((n, n))))
            problem.edges.append(Edge(u, v, problem.edges[0].row_of, problem.edges[0].col_of,
                                      problem.edges[0].table[::-1].copy()))
        got = _presolved_or_error(problem)
        with monkeypatch.context() as m:
            m.setattr(module, "_eliminate", _eliminate_rebuilding_the_list)
            m.setattr(module, "_as_seen_from", _as_seen_from_whole_table)
            expected = _presolved_or_error(problem)
        assert got == expected
        if not isinstance(expected, str):
            eliminated += len(expected[2])
            dominated += sum(len(d) for d in expected[3].values())
    assert eliminated > 300 and dominated > 300


def _presolved_or_error(problem):
    """``_presolved_arrays`` of the presolve, or the error it raises (a node left with
    no finite strategy has no memory spread: both trees refuse it alike)."""
    try:
        return _presolved_arrays(presolve(problem.node_costs, problem.edges,
                                          problem.memory_terms))
    except ValueError as e:
        return f"ValueError: {e}"
