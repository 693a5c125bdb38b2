"""A stage plan moved onto identical layers elsewhere (``passes/pipeline_search/transplant.py``) is the plan
the ILP makes there: same strategies position by position, same estimates; a graph of
another structure gets none."""

from __future__ import annotations

import pytest
from search_models import exact_stages, small_cluster, small_gpt_graph

import torchalpa
from torchalpa.passes.pipeline_search.layers import assign_layers
from torchalpa.passes.pipeline_search.stage_solve import plan_stage, stage_request
from torchalpa.passes.pipeline_search.subgraph import stage_subgraph
from torchalpa.passes.pipeline_search.transplant import transplant
from torchalpa.passes.sharding.intra_op import plan_intra_op


@pytest.fixture(scope="module")
def gpt():
    graph = small_gpt_graph(num_layers=6)
    method = torchalpa.PipeshardParallel(
        num_micro_batches=4, layer_option=torchalpa.AutoLayerOption(layer_num=6),
        auto_sharding_option=torchalpa.AutoShardingOption(solver="highs"))
    return graph, assign_layers(graph, method, 4), method


def _stage(graph, layer, k, i):
    return stage_subgraph(graph, {n: (0 if k <= v <= i else 1) for n, v in layer.items()},
                          0).graph


def _mesh():
    cluster = small_cluster(1, nodes=1, devices=4)
    return cluster.logical_mesh((2, 2))


def test_a_plan_moved_to_identical_layers_is_their_own_plan(gpt):
    graph, layer, method = gpt
    donor, target = _stage(graph, layer, 1, 2), _stage(graph, layer, 3, 4)
    intra = method.intra_op_method(None)
    solved = plan_intra_op(donor, _mesh(), intra, in_flight=2,
                           blocks=donor.meta.get("repeated_blocks") or None)
    own = plan_intra_op(target, _mesh(), intra, in_flight=2,
                        blocks=target.meta.get("repeated_blocks") or None)
    moved = transplant(solved, donor, target, _mesh(), intra)
    assert moved is not None
    assert moved.graph_fingerprint == target.fingerprint() != solved.graph_fingerprint
    assert [s.node for s in moved.strategies] == [s.node for s in own.strategies]
    assert [(s.inputs, s.outputs) for s in moved.strategies] == \
        [(s.inputs, s.outputs) for s in solved.strategies]
    for key in ("step_time_s", "model_state_bytes_per_device", "activation_bytes_per_device",
                "saved_activation_bytes_per_device"):
        assert getattr(moved.estimates, key) == pytest.approx(getattr(own.estimates, key), rel=1e-9)
    assert {p.name for p in moved.parameters} == {p.name for p in own.parameters}
    assert len(moved.collectives) == len(own.collectives)


def test_layers_of_another_structure_get_no_plan(gpt):
    graph, layer, method = gpt
    first, middle = _stage(graph, layer, 0, 1), _stage(graph, layer, 2, 3)
    intra = method.intra_op_method(None)
    solved = plan_intra_op(first, _mesh(), intra)
    assert transplant(solved, first, middle, _mesh(), intra) is None


def test_the_search_moves_a_solved_plan_to_identical_layers_at_assembly(gpt):
    """The DP prices layers 3-4 with 3 micro-batches in flight from its solve of layers
    1-2 with 2 (identical layers, the plan still fits): no ILP. The assembly then gets
    layers 3-4's plan moved from layers 1-2's, the plan the ILP makes for them."""
    graph, layer, method = gpt
    cluster = small_cluster(1, nodes=1, devices=4)
    costs = exact_stages(graph, layer, cluster, method)
    first = costs.exact(1, 2, (1, 4), (2, 2), 2)
    solves = costs.exact_solves
    assert costs.exact(3, 4, (1, 4), (2, 2), 3) == first
    assert costs.exact_solves == solves and costs.reused_in_flight == 1
    assert (3, 4, (1, 4), (2, 2), False, 3, False) not in costs.exact_plans
    target = _stage(graph, layer, 3, 4)
    request = stage_request(target, cluster.logical_mesh((2, 2)), method, None, "global", 3,
                            None)
    moved = costs.donated(3, 4, (1, 4), (2, 2), False, 3, False, request)
    assert moved is not None and costs.transplanted == 1
    own = plan_stage(request)
    assert moved.graph_fingerprint == own.graph_fingerprint
    assert moved.estimates.step_time_s == pytest.approx(own.estimates.step_time_s,
                                                           rel=1e-9)
