"""A stage whose memory floor is above its budget costs inf without an ILP
(``stage_solve.cannot_fit``, ``ExactStages._solve_stage``): every plan holds at least the
floor at some point (``MemoryModel.lower_timeline``), so the floor must never refuse a
stage the exact solve fits, and where it refuses, the exact solve finds nothing either."""

from __future__ import annotations

import pytest
from search_models import small_exact_stages, small_gpt_graph

from torchalpa.core.plan_records import known
from torchalpa.core.switches import PassSwitches
from torchalpa.passes.pipeline_search.search_keys import PlanKey
from torchalpa.passes.pipeline_search.stage_solve import StageRequest, cannot_fit
from torchalpa.passes.pricing.memory import in_flight_bytes
from torchalpa.passes.sharding.intra_op import memory_floor

INF = float("inf")


@pytest.fixture(scope="module")
def gpt_graph():
    return small_gpt_graph()


def _costs(graph, memory_gb: float):
    return small_exact_stages(graph, memory_gb)


def _request(costs, k: int, i: int, submesh, view, flight: int) -> StageRequest:
    problem = costs.problem
    method = problem.method
    return StageRequest(problem.stage_graph(k, i), problem.mesh(submesh, view),
                        method.intra_op_method(method.auto_sharding_option), problem.inputs,
                        flight, method.num_micro_batches)


def _peak(costs, k: int, i: int, submesh, view, flight: int, lean: bool) -> float:
    """The bytes per device the exact plan of the stage holds with ``flight`` in flight."""
    e = costs.exact_plans[PlanKey(k, i, submesh, view, lean, flight, False)].estimates
    return in_flight_bytes(known(e.model_state_bytes_per_device),
                           known(e.activation_bytes_per_device),
                           known(e.saved_activation_bytes_per_device), flight)


@pytest.mark.parametrize("k, i, submesh, view, flight", [
    (0, 0, (1, 2), (2,), 1), (0, 1, (2, 2), (2, 2), 1), (1, 2, (2, 2), (4,), 1),
    (0, 0, (2, 2), (2, 2), 3)])
def test_the_floor_refuses_no_stage_the_exact_solve_fits(gpt_graph, k, i, submesh, view,
                                                         flight):
    """20 MB devices: stages whose exact plans fit with little to spare (their peaks
    within 3 % of the budget); each is solved with the floor off, and the floor stays at
    or below its plan's peak and is not refused."""
    costs = _costs(gpt_graph, 0.02)
    with PassSwitches.using(stage_floor=False):
        latency, option = costs.exact(k, i, submesh, view, flight)
    assert latency < INF
    request = _request(costs, k, i, submesh, view, flight)
    floor, budget = memory_floor(request.graph, request.mesh, request.method,
                                 inputs=request.inputs, in_flight=flight, memo=costs.memo,
                                 step_micro_batches=request.micro_batches)
    peak = _peak(costs, k, i, submesh, view, flight, option is not None)
    assert budget is not None and 0 < floor <= peak
    assert not cannot_fit(request, costs.memo)


@pytest.mark.parametrize("k, i, submesh, view, flight", [
    (0, 1, (2, 2), (2, 2), 3), (0, 1, (1, 2), (2,), 1), (0, 0, (1, 2), (2,), 3)])
def test_a_stage_over_its_floor_costs_inf_without_an_ilp(gpt_graph, k, i, submesh, view,
                                                         flight):
    """The same devices: stages the exact solve finds no plan for (one or two ILPs, floor
    off) are refused by their floor (no ILP), and cost inf as before."""
    costs = _costs(gpt_graph, 0.02)
    assert costs.exact(k, i, submesh, view, flight) == (INF, None)
    assert (costs.exact_solves, costs.floored) == (0, 1)
    before = _costs(gpt_graph, 0.02)
    with PassSwitches.using(stage_floor=False):
        assert before.exact(k, i, submesh, view, flight) == (INF, None)
    assert before.exact_solves >= 1 and before.floored == 0


@pytest.mark.parametrize("memory_gb, fits", [(0.02, False), (0.05, True)])
def test_a_recomputed_stage_is_floored_in_the_budget_its_inputs_leave(gpt_graph, memory_gb,
                                                                      fits):
    """Recomputed, a stage is planned with one micro-batch in flight in what the other's
    kept inputs leave: layers 0-3 on two devices with 2 in flight have no plan in 20 MB
    (refused by the floor from that lowered budget, no ILP; inf with the floor off too),
    and one in 50 MB, which the floor lets the ILP find."""
    costs = _costs(gpt_graph, memory_gb)
    latency, _ = costs.exact(0, 3, (1, 2), (2,), 2, recompute=True)
    assert (latency < INF, costs.floored) == (fits, 0 if fits else 1)
    assert costs.exact_solves == (1 if fits else 0)
    if not fits:
        before = _costs(gpt_graph, memory_gb)
        with PassSwitches.using(stage_floor=False):
            assert before.exact(0, 3, (1, 2), (2,), 2, recompute=True) == (INF, None)
        assert before.exact_solves >= 1
