"""A stage the solver proves no plan fits is not solved again with sharded states
(``ExactStages._solve_stage``): the sharded-states solve it skips could not have found a
plan, and a solve stopped without a proof (its clock, its memory rounds) still tries it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from search_models import small_exact_stages, small_gpt_graph

from torchalpa.core.switches import PassSwitches
from torchalpa.passes.pipeline_search import exact_stages as exact_module
from torchalpa.passes.pipeline_search.stage_recompute import recompute_option
from torchalpa.passes.pipeline_search.stage_solve import StageRequest, plan_stage, search_option
from torchalpa.passes.sharding.ilp import InfeasibleError, MemoryNotSettled, SolverStopped


@pytest.fixture(scope="module")
def gpt_graph():
    return small_gpt_graph()


def _costs(graph, memory_gb: float):
    return small_exact_stages(graph, memory_gb)


def _sharded_solve(costs, k: int, i: int, flight: int, recompute: bool) -> None:
    """The sharded-states ILP the search skipped, solved as ``_solve_stage`` would have."""
    problem = costs.problem
    method = problem.method
    option = replace(method.auto_sharding_option, parameters="sharded")
    if recompute:
        option = recompute_option(option, problem.budget(), costs.costs.received(k, i), flight)
        assert option is not None
    plan_stage(StageRequest(problem.stage_graph(k, i), problem.mesh((1, 2), (2,)),
                            method.intra_op_method(search_option(option, None)),
                            problem.inputs, 1 if recompute else flight,
                            method.num_micro_batches), costs.memo)


@pytest.mark.parametrize("memory_gb, flight, recompute", [
    (0.02, 1, False), (0.015, 4, False), (0.02, 2, True)])
def test_a_stage_proved_not_to_fit_skips_the_sharded_solve_that_could_not_fit(
        gpt_graph, memory_gb, flight, recompute):
    """Budgets below what layers 0-1 need on two devices: one ILP proves it, the stage
    costs inf, and the sharded-states ILP, solved here anyway, finds no plan either. (Its
    memory floor proves it before any ILP, ``tests/test_stage_floor.py``: off here.)"""
    costs = _costs(gpt_graph, memory_gb)
    with PassSwitches.using(stage_floor=False):
        latency, option = costs.exact(0, 1, (1, 2), (2,), flight, recompute=recompute)
    assert latency == float("inf") and option is None
    assert (costs.exact_solves, costs.proved_unfit) == (1, 1)
    with pytest.raises(InfeasibleError):
        _sharded_solve(costs, 0, 1, flight, recompute)


@pytest.mark.parametrize("stop", [SolverStopped, MemoryNotSettled])
def test_a_stop_without_a_proof_still_tries_sharded_states(gpt_graph, monkeypatch, stop):
    """The first solve stopped by its clock or out of memory rounds proves nothing: the
    sharded-states solve follows, and its plan is the stage's."""
    solve = exact_module.plan_stage

    def stopped_unless_sharded(request, memo=None):
        if request.method.auto_sharding_option.parameters != "sharded":
            raise stop("stopped")
        return solve(request, memo)

    monkeypatch.setattr(exact_module, "plan_stage", stopped_unless_sharded)
    costs = _costs(gpt_graph, 10.0)
    latency, option = costs.exact(0, 1, (1, 2), (2,), 1)
    assert latency < float("inf") and option is not None and option.parameters == "sharded"
    assert (costs.exact_solves, costs.proved_unfit) == (2, 0)


def test_a_stage_that_fits_is_solved_once(gpt_graph):
    """Room to spare: one ILP, its plan kept, nothing counted as proved not to fit."""
    costs = _costs(gpt_graph, 10.0)
    latency, option = costs.exact(0, 1, (1, 2), (2,), 1)
    assert latency < float("inf") and option is None
    assert (costs.exact_solves, costs.proved_unfit) == (1, 0)


def test_ignoring_the_proof_solves_sharded_states_for_the_same_answer(gpt_graph):
    """``PassSwitches.trust_proofs`` off (the search before): the sharded-states ILP runs
    and fails, the stage costs inf all the same."""
    costs = _costs(gpt_graph, 0.02)
    with PassSwitches.using(trust_proofs=False, stage_floor=False):
        assert costs.exact(0, 1, (1, 2), (2,), 1) == (float("inf"), None)
    assert (costs.exact_solves, costs.proved_unfit) == (2, 0)
