"""The direct HiGHS model (``passes/ilp_highs.py``) against PuLP's: same plan, same objective."""

from __future__ import annotations

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
    from torchalpa.methods import ShardParallel
    from torchalpa.passes import ilp
    from torchalpa.passes.intra_op import plan_intra_op
    monkeypatch.setattr(ilp, "DIRECT_HIGHS", direct)
    mesh = torchalpa.Cluster.h100(devices_per_node=4).logical_mesh(shape)
    # no time limit: on a loaded machine a limit could stop either solve early
    option = torchalpa.AutoShardingOption(solver="highs", memory_budget_per_device=budget,
                                          time_limit=None)
    return plan_intra_op(graph, mesh, ShardParallel(auto_sharding_option=option))


def _choices(plan):
    return {s.node: repr(s.to_dict()) for s in plan.strategies}


@pytest.mark.parametrize("shape", [(4,), pytest.param((2, 2), marks=pytest.mark.slow)])
def test_direct_highs_plans_what_pulp_plans(gpt_graph, monkeypatch, shape):
    slow = _plan(gpt_graph, monkeypatch, False, None, shape)
    fast = _plan(gpt_graph, monkeypatch, True, None, shape)
    assert fast.estimates["objective"] == pytest.approx(slow.estimates["objective"], rel=1e-12)
    assert fast.estimates["ilp_variables"] == slow.estimates["ilp_variables"]
    assert _choices(fast) == _choices(slow)


def test_direct_highs_under_a_memory_budget_and_when_nothing_fits(gpt_graph, monkeypatch):
    from torchalpa.passes.ilp import InfeasibleError
    free = _plan(gpt_graph, monkeypatch, True, None, (4,))
    peak = free.estimates["memory_per_device_bytes"]
    # a budget under the fastest plan's peak: both paths add the same memory rows
    slow = _plan(gpt_graph, monkeypatch, False, 0.8 * peak, (4,))
    fast = _plan(gpt_graph, monkeypatch, True, 0.8 * peak, (4,))
    assert fast.estimates["memory_per_device_bytes"] <= 0.8 * peak
    assert fast.estimates["objective"] == pytest.approx(slow.estimates["objective"], rel=1e-12)
    assert _choices(fast) == _choices(slow)
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

    from torchalpa.passes.ilp import Edge, ILPProblem, solve_ilp
    problem = ILPProblem(node_costs={"a": np.array([1.0, 3.0]), "b": np.array([2.0])},
                         edges=[Edge("a", "b", np.array([0, 1]), np.array([0]),
                                     np.array([[0.5], [0.0]]))])
    solution = solve_ilp(problem, solver="highs")
    assert solution.choice == {"a": 0, "b": 0}
    assert solution.objective == 3.5
    assert solution.num_variables == 0      # nothing was left for the solver
