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
from torchalpa.passes.pipeline_search import layer_bound
from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
from torchalpa.passes.pipeline_search.layer_bound import (
    CannotBeat,
    LayerSums,
    layers_floor_s,
    round_trip_floor_s,
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
from torchalpa.passes.pipeline_search.stage_costs import StageCosts


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
    problem = SearchProblem(graph, layer, cluster, method, "global")
    costs = StageCosts(problem, LayerCosts(problem, cache, PricingMemo()))
    floors = layer_floors(graph, layer, cluster, optimizer_states=method.optimizer_states)
    ops = pipeline_floor_s(floors, cluster.num_devices, method.num_micro_batches,
                           cluster.memory_per_device or math.inf)
    return est, search_floor_s(costs), search_floor_s(costs, slack=0.0), ops


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
    plain = LayerSums(sums, sums)
    # one stage on both devices: 4 x (1 + 1); two stages of one device: 2 + 4 x 2
    assert layers_floor_s(floors, plain, 2, 4, slack=0.0) == pytest.approx(8.0)
    assert layers_floor_s(floors, plain, 2, 4, slack=0.5) == pytest.approx(4.0)
    none = LayerSums(np.zeros((2, 2)), np.zeros((2, 2)))
    assert layers_floor_s(floors, none, 2, 4) == pytest.approx(pipeline_floor_s(floors, 2, 4))


def test_the_once_per_step_share_counts_once_after_the_forwards_before():
    """One layer per device, 4 micro-batches, each 1 s per micro-batch of which 0.25 s is
    its share of once-per-step work (1 s in all): the second stage's 4 x 0.75 s after the
    first's 0.75 s (both ways) is 3.75 s; with its once-per-step second, after the first's
    forward only (a third of 0.75 s), 0.25 + 4 s = 4.25 s; one stage over both devices
    (0.5 s per micro-batch, all of it once-per-step work) 2 s."""
    floors = LayerFloors((1, 2), np.zeros((2, 2)), np.zeros(2), np.zeros(2))
    sums = LayerSums(np.array([[0.75, 0.0], [0.75, 0.0]]),
                     np.array([[1.0, 0.25], [1.0, 0.25]]))
    assert layers_floor_s(floors, sums, 2, 4, slack=0.0) == pytest.approx(2.0)
    one = LayerSums(sums.step_s[:, :1], sums.whole_s[:, :1])
    single = LayerFloors((1,), np.zeros((2, 1)), np.zeros(2), np.zeros(2))
    assert layers_floor_s(single, one, 2, 4, slack=0.0) == pytest.approx(4.25)


def test_round_trips_bound_every_stage_and_its_tail():
    """Two layers of 1 s per micro-batch on one device (0.4 s on two), forward's values
    across the cut 0.5 s, 4 micro-batches on 2 devices. Two stages of one device: the
    first starts micro-batch m + 2 after m's round trip, 1 + 1 + 2 x 0.5 = 3 s, so 2 x 3
    s; the second runs 4 x 1 s. One stage on both: 4 x 0.8 s, no cut. The states decide
    which fits."""
    cuts = np.array([0.5])
    step = np.array([[1.0, 0.4], [1.0, 0.4]])
    floors = LayerFloors((1, 2), np.zeros((2, 2)), np.zeros(2), np.array([10.0, 10.0]))
    assert round_trip_floor_s(floors, step, cuts, 2, 4) == pytest.approx(3.2)
    apart = LayerFloors((1,), np.zeros((2, 1)), np.zeros(2), np.array([10.0, 10.0]))
    assert round_trip_floor_s(apart, step[:, :1], cuts, 2, 4) == pytest.approx(6.0)
    # one layer per device only (20 bytes do not fit 10 per device on one device's share)
    assert round_trip_floor_s(floors, step, cuts, 2, 4, budget=9.0) == math.inf
    # a layer barred from the two-device size: the two stages again
    barred = np.array([[1.0, math.inf], [1.0, 0.4]])
    assert round_trip_floor_s(floors, barred, cuts, 2, 4) == pytest.approx(6.0)


def test_a_search_stops_before_its_stage_ilps_where_its_layers_cannot_beat():
    """``refuse_above`` below the layers' bound stops the search with that bound (no
    stage ILP: the cache holds no stage solve); above it, the plan is the one found
    without it."""
    graph, cluster, method = CASES["small GPT, small_cluster(), 8 micro-batches"]()
    cache = SolveCache()
    plan = plan_pipeline(graph, cluster, method, solves=cache)
    layer = assign_layers(graph, method, cluster.num_devices)
    problem = SearchProblem(graph, layer, cluster, method, "global")
    bound = search_floor_s(StageCosts(problem, LayerCosts(problem, cache, PricingMemo())))
    fresh = SolveCache()
    with pytest.raises(CannotBeat) as stopped:
        plan_pipeline(graph, cluster, method, solves=fresh, refuse_above=bound)
    assert stopped.value.bound_s == pytest.approx(bound)
    assert not any(key[0] != "layer" for key in fresh._items)
    again = plan_pipeline(graph, cluster, method, refuse_above=bound * 1.01)
    assert again.to_json() == plan.to_json() or \
        again.estimates.step_time_s == plan.estimates.step_time_s


def _small_gpt_model():
    """The small GPT of ``small_gpt_graph`` as a model on the meta device: (model, batch,
    loss_fn)."""
    import torch

    import torchalpa.models as zoo
    config = zoo.GPTConfig(vocab_size=512, max_seq_len=64, num_layers=4, num_heads=4,
                           hidden=256, dropout=0.0)
    workload = zoo.Workload("gpt", config, 8, 64)
    with torch.device("meta"):
        return workload.build(), workload.example_inputs(), workload.loss_fn


def test_autoparallel_stops_pipelines_by_their_layers(monkeypatch):
    """The small GPT's pipelines on ``small_cluster()`` (4 layers, 1-8 micro-batches,
    remat none or selective), with the layers' bound made three times the layers' sums
    (a negative slack: not a bound, but what makes AutoParallel's handling of one
    visible here): the first plan found stands, each later candidate of remat none is
    stopped after its layer ILPs with its bound in the notes, and each selective one
    alike is not solved at all (it recomputes more)."""
    monkeypatch.setattr(layer_bound, "SLACK", -2.0)
    model, batch, loss_fn = _small_gpt_model()
    method = torchalpa.AutoParallel(pipeline=True, remat=("none", "selective"),
                                    layer_option=torchalpa.AutoLayerOption(layer_num=4))
    plan = torchalpa.plan(model, batch, loss_fn, cluster=small_cluster(), method=method)
    stopped = [n for n in plan.notes if LAYER_BOUND in n]
    own = [n for n in stopped if "stopped after its layer ILPs" in n]
    alike = [n for n in stopped if "which recomputes less" in n]
    assert own and all("remat=none" in n for n in own), plan.notes
    assert alike and all("remat=selective" in n for n in alike), plan.notes
    for note in stopped:
        bound = float(note.split(LAYER_BOUND)[1].split()[0])
        assert bound * (1 + method.tolerance) >= plan.estimates.step_time_s
    assert any(f"{len(stopped)} pipeline candidates refused by their layers' own plans" in n
               for n in plan.notes)
