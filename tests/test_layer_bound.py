"""The bound of a searched pipeline by its layers' own plans (passes/pipeline_search/
layer_bound.py): below the estimate of every pipeline the search plans here, above the
bound by the ops' rooflines, what stops a pipeline search before its stage ILPs
(``plan_pipeline(refuse_above=)``), and what AutoParallel refuses candidates by."""

from __future__ import annotations

import math

import numpy as np
import pytest
from search_models import meta_tiny_gpt, small_cluster, small_gpt_graph, small_pipeline

import torchalpa
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel.auto import LAYER_BOUND
from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
from torchalpa.passes.pipeline_search.layer_bound import (
    CannotBeat,
    layers_floor_s,
    search_floor_s,
)
from torchalpa.passes.pipeline_search.layer_cache import SolveCache
from torchalpa.passes.pipeline_search.layer_costs import LayerCosts
from torchalpa.passes.pipeline_search.layers import assign_layers
from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
from torchalpa.passes.pipeline_search.search_problem import SearchProblem
from torchalpa.passes.pipeline_search.shape_bound import (
    LayerFloors,
    layer_floors,
    pipeline_floor_s,
)


def _h100(devices_per_node: int) -> torchalpa.Cluster:
    return torchalpa.Cluster.h100(num_nodes=2, devices_per_node=devices_per_node)


def _tiny(micro_batches: int):
    model, batch, loss_fn = meta_tiny_gpt()
    micro = 8 // micro_batches
    return capture(model, tuple(x[:micro] for x in batch), loss_fn).graph


def _searched(graph, cluster, method):
    """(the plan's estimate, the layers' bound, the ops' bound) of ``graph``'s search."""
    cache = SolveCache()
    est = plan_pipeline(graph, cluster, method, solves=cache).estimates.step_time_s
    layer = assign_layers(graph, method, cluster.num_devices)
    layers = LayerCosts(SearchProblem(graph, layer, cluster, method, "global"), cache,
                        PricingMemo())
    floors = layer_floors(graph, layer, cluster, optimizer_states=method.optimizer_states)
    ops = pipeline_floor_s(floors, cluster.num_devices, method.num_micro_batches,
                           cluster.memory_per_device or math.inf)
    return est, search_floor_s(layers), search_floor_s(layers, slack=0.0), ops


CASES = {
    "tiny GPT, 2 x 1 H100, 8 micro-batches": lambda: (
        _tiny(8), _h100(1), torchalpa.PipeshardParallel(
            num_micro_batches=8, layer_option=torchalpa.AutoLayerOption(layer_num=2))),
    "tiny GPT, 2 x 2 H100, 8 micro-batches": lambda: (
        _tiny(8), _h100(2), torchalpa.PipeshardParallel(
            num_micro_batches=8, layer_option=torchalpa.AutoLayerOption(layer_num=4))),
    "tiny GPT, 2 x 2 H100, 2 micro-batches": lambda: (
        _tiny(2), _h100(2), torchalpa.PipeshardParallel(
            num_micro_batches=2, layer_option=torchalpa.AutoLayerOption(layer_num=4))),
    "small GPT, small_cluster(), 8 micro-batches": lambda: (
        small_gpt_graph(4), small_cluster(), small_pipeline(4)),
    "small GPT, 2 x 2 H100, 8 micro-batches": lambda: (
        small_gpt_graph(4), _h100(2), small_pipeline(4)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_layers_bound_is_below_the_pipelines_planned(case):
    """Each pipeline the search plans is estimated at or above the bound its layers' own
    plans give (with the slack, and here even without it), and that bound is at or above
    the ops' rooflines' (``shape_bound.py``), which it takes where a layer is cheaper."""
    est, bound, bare, ops = _searched(*CASES[case]())
    assert 0 < ops <= bound <= bare
    assert bare <= est * (1 + 1e-9)


def test_the_layers_bound_takes_the_dearer_of_a_layers_plan_and_its_floor():
    """Two layers on one device or two, 4 micro-batches: the layers' plans (2 s and 1 s
    per micro-batch) decide where they are dearer than the floors, scaled by the slack;
    a layer with no plan (0) keeps its floor."""
    floors = LayerFloors((1, 2), np.array([[1.0, 0.5], [1.0, 0.5]]), np.zeros(2),
                         np.zeros(2))
    sums = np.array([[2.0, 1.0], [2.0, 1.0]])
    # one stage on both devices: 4 x (1 + 1); two stages of one device: 2 + 4 x 2
    assert layers_floor_s(floors, sums, 2, 4, slack=0.0) == pytest.approx(8.0)
    assert layers_floor_s(floors, sums, 2, 4, slack=0.5) == pytest.approx(4.0)
    assert layers_floor_s(floors, np.zeros((2, 2)), 2, 4) == \
        pytest.approx(pipeline_floor_s(floors, 2, 4))


def test_a_search_stops_before_its_stage_ilps_where_its_layers_cannot_beat():
    """``refuse_above`` below the layers' bound stops the search with that bound (no
    stage ILP: the cache holds no stage solve); above it, the plan is the one found
    without it."""
    graph, cluster, method = CASES["small GPT, small_cluster(), 8 micro-batches"]()
    cache = SolveCache()
    plan = plan_pipeline(graph, cluster, method, solves=cache)
    layer = assign_layers(graph, method, cluster.num_devices)
    bound = search_floor_s(LayerCosts(SearchProblem(graph, layer, cluster, method, "global"),
                                      cache, PricingMemo()))
    fresh = SolveCache()
    with pytest.raises(CannotBeat) as stopped:
        plan_pipeline(graph, cluster, method, solves=fresh, refuse_above=bound)
    assert stopped.value.bound_s == pytest.approx(bound)
    assert not any(key[0] != "layer" for key in fresh._items)
    again = plan_pipeline(graph, cluster, method, refuse_above=bound * 1.01)
    assert again.to_json() == plan.to_json() or \
        again.estimates.step_time_s == plan.estimates.step_time_s


def test_autoparallel_stops_pipelines_by_their_layers():
    """The tiny GPT's pipelines of 1, 2, 4 and 8 micro-batches on 2 x 2 H100s (4 layers):
    a candidate the stages' bound lets through but its layers' plans bound above the
    first plan is stopped before its stage ILPs, the notes say so, and the plan is the
    one found without that bound (the stopped candidates could not have won)."""
    model, batch, loss_fn = meta_tiny_gpt()
    method = torchalpa.AutoParallel(pipeline=True, remat=("none",),
                                    layer_option=torchalpa.AutoLayerOption(layer_num=4))
    plan = torchalpa.plan(model, batch, loss_fn, cluster=_h100(2), method=method)
    stopped = [n for n in plan.notes if LAYER_BOUND in n]
    assert stopped, plan.notes
    for note in stopped:
        bound = float(note.split(LAYER_BOUND)[1].split()[0])
        assert bound * (1 + method.tolerance) >= plan.estimates.step_time_s
    assert any("refused by their layers' own plans" in n for n in plan.notes)
