"""The direct HiGHS model (``passes/sharding/ilp_highs.py``) against PuLP's: same plan, same objective."""

from __future__ import annotations

import dataclasses

import pytest
import torch


@pytest.fixture(scope="module")
def gpt_graph():
    import torchalpa.models as zoo
    from torchalpa.frontends.torch_export import capture
    workload = zoo.tiny("gpt", batch_size=4)
    with torch.device("meta"):
        model, batch = workload.build(), workload.example_inputs()
    return capture(model, batch, workload.loss_fn).graph


def _plan(graph, monkeypatch, direct: bool, budget: float | None, shape=(2, 2)):
    import torchalpa
    from torchalpa.core.options import ShardParallel
    from torchalpa.core.switches import PassSwitches
    from torchalpa.passes.pricing import cost
    from torchalpa.passes.sharding.intra_op import plan_intra_op
    # no host issue cost and no kernel floor: on a GPU a tiny op costs the longer of its
    # kernel, the kernel floor and its issue, so the tiny GPT's small ops would cost the
    # floor or the issue whatever their layout, and the two solvers could break those ties
    # differently
    monkeypatch.setattr(cost, "KERNEL_FLOOR_S", 0.0)
    cluster = dataclasses.replace(torchalpa.Cluster.h100(devices_per_node=4), kernel_launch_s=0.0)
    mesh = cluster.logical_mesh(shape)
    # no time limit: on a loaded machine a limit could stop either solve early
    option = torchalpa.AutoShardingOption(solver="highs", memory_budget_per_device=budget,
                                          time_limit=None)
    with PassSwitches.using(direct_highs=direct):
        return plan_intra_op(graph, mesh, ShardParallel(auto_sharding_option=option))


def _choices(plan):
    return {s.node: repr(s.to_dict()) for s in plan.strategies}


@pytest.mark.parametrize("shape", [(4,), pytest.param((2, 2), marks=pytest.mark.slow)])
def test_direct_highs_plans_what_pulp_plans(gpt_graph, monkeypatch, shape):
    slow = _plan(gpt_graph, monkeypatch, False, None, shape)
    fast = _plan(gpt_graph, monkeypatch, True, None, shape)
    assert fast.estimates.objective == pytest.approx(slow.estimates.objective, rel=1e-12)
    assert fast.estimates.ilp_variables == slow.estimates.ilp_variables
    assert _choices(fast) == _choices(slow)


def test_direct_highs_under_a_memory_budget_and_when_nothing_fits(gpt_graph, monkeypatch):
    from torchalpa.passes.sharding.ilp import InfeasibleError
    free = _plan(gpt_graph, monkeypatch, True, None, (4,))
    peak = free.estimates.memory_per_device_bytes
    # a budget under the fastest plan's peak: both paths add the same memory rows. 0.95 of
    # it binds as 0.8 did (both plans dearer than the free one) in a tenth of the solver's
    # time (0.8: about 11 s a path; 0.6: 20 s)
    budget = 0.95 * peak
    slow = _plan(gpt_graph, monkeypatch, False, budget, (4,))
    fast = _plan(gpt_graph, monkeypatch, True, budget, (4,))
    assert fast.estimates.memory_per_device_bytes <= budget
    assert slow.estimates.memory_per_device_bytes <= budget
    assert fast.estimates.objective > free.estimates.objective * (1 + 1e-9)
    # the same optimum; plans that tie may differ in a layout that costs nothing (a
    # view's), so the choices are not compared
    assert fast.estimates.objective == pytest.approx(slow.estimates.objective, rel=1e-12)
    # too small for any plan: the minimum-peak problem (the peak variable) names the need
    with pytest.raises(InfeasibleError) as fast_error:
        _plan(gpt_graph, monkeypatch, True, 1e3, (4,))
    with pytest.raises(InfeasibleError) as slow_error:
        _plan(gpt_graph, monkeypatch, False, 1e3, (4,))
    assert str(fast_error.value) == str(slow_error.value)


def test_direct_highs_when_presolve_decides_every_node():
    """A problem left with no columns (every node closed by presolve) is solved, not
    'Not Solved' (a data-parallel grid with the batch pinned reaches it)."""
    import numpy as np

    from torchalpa.passes.sharding.ilp import Edge, ILPProblem, solve_ilp
    problem = ILPProblem(node_costs={"a": np.array([1.0, 3.0]), "b": np.array([2.0])},
                         edges=[Edge("a", "b", np.array([0, 1]), np.array([0]),
                                     np.array([[0.5], [0.0]]))])
    solution = solve_ilp(problem, solver="highs")
    assert solution.choice == {"a": 0, "b": 0}
    assert solution.objective == 3.5
    assert solution.num_variables == 0      # nothing was left for the solver


def test_a_start_reaches_highs_at_its_own_columns(monkeypatch):
    """``model.initial`` is handed to HiGHS (``setSolution``) at the positions its columns
    take in HiGHS's name-sorted order, so a solve stopped by its time limit keeps at least
    that plan (without a start, a limited solve of a ResNet-18 ILP returned a plan 3x the
    optimum's cost)."""
    import highspy

    from torchalpa.passes.sharding.ilp_highs import solve_with_highs
    from torchalpa.passes.sharding.ilp_model import LinearModel
    model = LinearModel()
    for name, cost in (("s_b_0", 3.0), ("s_a_0", 1.0), ("s_a_1", 2.0), ("s_b_1", 1.0)):
        model.column(name, cost, 1.0, True)
    model.row([(1, 1.0), (2, 1.0)], 1.0, 1.0)        # node a: one of s_a_0, s_a_1
    model.row([(0, 1.0), (3, 1.0)], 1.0, 1.0)        # node b: one of s_b_0, s_b_1
    model.initial = {2: 1.0, 1: 0.0, 0: 1.0, 3: 0.0}  # a feasible, dearer start: a_1, b_0
    handed = {}
    original = highspy.Highs.setSolution

    def spy(self, *args):
        if len(args) == 3:
            handed.update(zip(args[1].tolist(), args[2].tolist()))
        return original(self, *args)

    monkeypatch.setattr(highspy.Highs, "setSolution", spy)
    status, values, _ = solve_with_highs(model, time_limit=None, gap=None, verbose=False)
    by_sorted_name = sorted(model.names)
    assert {by_sorted_name[i]: v for i, v in handed.items()} == {
        "s_a_1": 1.0, "s_a_0": 0.0, "s_b_0": 1.0, "s_b_1": 0.0}
    assert status == "Optimal" and values.tolist() == [0.0, 1.0, 0.0, 1.0]   # a_0, b_1


def test_auto_means_highs_when_highspy_imports(monkeypatch):
    import importlib.util

    from torchalpa.passes.sharding import ilp
    assert ilp.resolve_solver("auto") == "highs"
    assert ilp.resolve_solver("cbc") == "cbc"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "highspy" else real(name, *a))
    assert ilp.resolve_solver("auto") == "cbc"



def _two_node_model():
    from torchalpa.passes.sharding.ilp_model import LinearModel
    model = LinearModel()
    for name, cost in (("s_a_0", 1.0), ("s_a_1", 2.0), ("s_b_0", 3.0), ("s_b_1", 1.0)):
        model.column(name, cost, 1.0, True)
    model.row([(0, 1.0), (1, 1.0)], 1.0, 1.0)
    model.row([(2, 1.0), (3, 1.0)], 1.0, 1.0)
    return model


def test_highs_options_laid_over_the_planners(monkeypatch):
    """``started_highs`` sets ``MIP_OPTIONS`` and then the options it is given (how
    ``benchmarks/highs_options_ab.py`` weighs a setting on the planner's own ILPs); a
    misspelt option is refused, not ignored (HiGHS only logs it), so no A/B runs the
    defaults under another setting's name."""
    from torchalpa.passes.sharding import ilp_highs
    monkeypatch.setattr(ilp_highs, "MIP_OPTIONS", {"mip_allow_restart": False})
    h, _ = ilp_highs.started_highs(_two_node_model(), time_limit=None, gap=None,
                                   verbose=False,
                                   options={"mip_heuristic_run_feasibility_jump": False})
    assert h.getOptionValue("mip_allow_restart")[1] is False
    assert h.getOptionValue("mip_heuristic_run_feasibility_jump")[1] is False
    h.run()
    assert h.getSolution().col_value == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="no_such_option"):
        ilp_highs.started_highs(_two_node_model(), time_limit=None, gap=None, verbose=False,
                                options={"no_such_option": 1})


def test_relaxations_solved_without_presolve_to_the_presolved_optimum(monkeypatch):
    """``linear_optimum`` solves a relaxation under ``LP_OPTIONS`` (HiGHS' presolve off:
    the search's LP bounds in a third of the CPU) and a model kept integral under HiGHS'
    defaults; the relaxation's optimum is the one HiGHS finds with its presolve, on
    random problems with edges and memory rows."""
    import highspy
    import numpy as np
    from test_presolve import random_problem

    from torchalpa.passes.sharding import ilp_highs
    from torchalpa.passes.sharding.ilp import InfeasibleError, _prepare
    seen: list[str] = []
    run = highspy.Highs.run

    def recorded(h):
        seen.append(h.getOptionValue("presolve")[1])
        return run(h)

    monkeypatch.setattr(highspy.Highs, "run", recorded)
    rng, compared = np.random.default_rng(3), 0
    for _ in range(60):
        try:
            model = _prepare(random_problem(rng, bool(compared % 2)), None).built.model
        except (InfeasibleError, ValueError):
            continue
        if not model.names:
            continue
        relaxed = ilp_highs.linear_optimum(model)
        with monkeypatch.context() as m:
            m.setattr(ilp_highs, "LP_OPTIONS", {})
            presolved = ilp_highs.linear_optimum(model)
        assert (relaxed is None) == (presolved is None)
        if relaxed is not None:
            assert relaxed == pytest.approx(presolved, rel=1e-9, abs=1e-6)
        ilp_highs.linear_optimum(model, integral=True)
        compared += 1
    assert compared > 20
    assert seen == ["off", "choose", "choose"] * compared


def test_edge_columns_in_bulk_as_one_by_one():
    """An edge's columns (``_add_edge`` through ``LinearModel.columns``): one per layout
    pair both ends can take with a finite price, named ``e<edge>_<p>_<q>`` in that
    order, continuous in [0, 1], priced at the table's scaled entry; a forbidden strategy's
    layout and an impossible pair get none."""
    import math

    import numpy as np

    from torchalpa.passes.sharding.ilp import Edge
    from torchalpa.passes.sharding.ilp_model import build_model
    table = np.array([[0.0, 2.0, math.inf], [1.0, 3.0, 4.0], [5.0, 6.0, 7.0]])
    costs = {"a": np.array([1.0, 2.0, math.inf]), "b": np.array([0.0, 1.0, 2.0])}
    edge = Edge("a", "b", np.arange(3), np.arange(3), table)
    built = build_model(costs, [edge], [], None, [], None, False, 10.0)
    model = built.model
    edge_columns = [i for i, name in enumerate(model.names) if name.startswith("e0_")]
    assert [model.names[i] for i in edge_columns] == ["e0_0_0", "e0_0_1", "e0_1_0",
                                                       "e0_1_1", "e0_1_2"]
    assert [model.cost[i] for i in edge_columns] == [0.0, 20.0, 10.0, 30.0, 40.0]
    assert all(model.upper[i] == 1.0 and not model.integer[i] for i in edge_columns)
    # each linking row: its edge columns at +1, the strategies writing or reading at -1
    rows = [sorted(zip(index, value)) for _, _, index, value in model.rows()]
    first = edge_columns[0]
    assert sorted([(first + 2, 1.0), (first + 3, 1.0), (first + 4, 1.0),
                   (built.strategy_columns["a"][1], -1.0)]) in rows
    assert sorted([(first + 1, 1.0), (first + 3, 1.0),
                   (built.strategy_columns["b"][1], -1.0)]) in rows


def _edge_one_row_at_a_time(model, s, e, tag, scale):
    """The reference ``_add_edge``: a column per finite pair by ``model.column`` in ``p``
    then ``q`` order, and one ``model.row`` per linking row (main's code before the bulk
    linking rows)."""
    import math

    from torchalpa.passes.sharding.ilp_model import layout_columns
    P, Q = e.table.shape
    row_sources = layout_columns(s[e.u], e.row_of, P)
    col_sources = layout_columns(s[e.v], e.col_of, Q)
    rows: list[list[int]] = [[] for _ in range(P)]
    cols: list[list[int]] = [[] for _ in range(Q)]
    for p in range(P):
        for q in range(Q):
            if row_sources[p] and col_sources[q] and math.isfinite(e.table[p, q]):
                col = model.column(f"{tag}_{p}_{q}", float(e.table[p, q] * scale), 1.0, False)
                rows[p].append(col)
                cols[q].append(col)
    for sums, sources in ((rows, row_sources), (cols, col_sources)):
        for held, source in zip(sums, sources):
            if source:
                model.row([(c, 1.0) for c in held] + [(c, -1.0) for c in source], 0.0, 0.0)


def _random_edge_problem(rng):
    """Nodes with one strategy (``FIXED``), forbidden strategies and layouts no strategy
    uses; edges (parallel ones too) with impossible pairs and zero prices."""
    import numpy as np

    from torchalpa.passes.sharding.ilp import Edge
    costs, layouts = {}, {}
    for n in range(int(rng.integers(2, 6))):
        count = int(rng.integers(1, 7))
        c = rng.integers(0, 4, count).astype(float)
        c[rng.random(count) < 0.2] = np.inf
        if not np.isfinite(c).any():
            c[0] = 1.0
        costs[f"n{n}"], layouts[f"n{n}"] = c, int(rng.integers(1, 5))
    names, edges = list(costs), []
    for _ in range(int(rng.integers(1, 7))):
        u, v = (str(x) for x in rng.choice(names, 2))
        P, Q = layouts[u] + int(rng.integers(0, 2)), layouts[v] + int(rng.integers(0, 2))
        table = rng.integers(0, 5, (P, Q)).astype(float) * rng.random()
        table[rng.random((P, Q)) < 0.3] = np.inf
        edges.append(Edge(u, v, rng.integers(0, layouts[u], len(costs[u])),
                          rng.integers(0, layouts[v], len(costs[v])), table))
    return costs, edges


def test_edge_linking_rows_in_bulk_as_one_row_at_a_time(monkeypatch):
    """``build_model``'s arrays with the edges built in bulk (numpy masks, ``link_rows``)
    equal, element for element and in order, those of the one-row-at-a-time reference on
    random problems: columns, costs, bounds, integrality, CSR rows and their bounds."""
    import numpy as np

    from torchalpa.passes.sharding import ilp_model
    rng = np.random.default_rng(0)
    fields = ("names", "cost", "upper", "integer", "row_lower", "row_upper", "starts",
              "index", "value")
    fixed_rows = 0
    for _ in range(300):
        costs, edges = _random_edge_problem(rng)
        bulk = ilp_model.build_model(costs, edges, [], None, [], None, False, 3.0).model
        with monkeypatch.context() as m:
            m.setattr(ilp_model, "_add_edge", _edge_one_row_at_a_time)
            reference = ilp_model.build_model(costs, edges, [], None, [], None, False, 3.0).model
        for name in fields:
            assert getattr(bulk, name) == getattr(reference, name), name
        fixed_rows += sum(lo == 1.0 for lo in bulk.row_lower)
    assert fixed_rows > 50          # linking rows with a node's only strategy in the bounds
