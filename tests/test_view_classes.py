"""View classes of the pipeline search: which views share a layer's solve, pricing a plan on
another view of its class, the views skipped and the notes that say so, and (slow) that the
shared search plans what the search solving every view plans."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
from torchalpa.core.switches import PassSwitches

GB = 1024 ** 3


def _cluster(nodes: int) -> torchalpa.Cluster:
    """Nodes of 4 devices, links between nodes 100x slower than within (issue 15)."""
    return torchalpa.Cluster(num_nodes=nodes, devices_per_node=4, memory_per_device=32 * GB,
                             peak_flops=112e12, memory_bandwidth=900e9,
                             intra_node_bandwidth=100e9, intra_node_latency=1e-6,
                             inter_node_bandwidth=1e9, inter_node_latency=1e-6)


def _view_mesh(cluster: torchalpa.Cluster, view: tuple[int, ...]):
    devices = 1
    for size in view:
        devices *= size
    nodes = max(1, devices // cluster.devices_per_node)
    return replace(cluster, num_nodes=nodes,
                   devices_per_node=min(devices, cluster.devices_per_node)).logical_mesh(view)


def test_views_that_shard_the_same_dims_over_the_same_links_share_a_class():
    from torchalpa.passes.pipeline_search.view_classes import view_class
    cluster = _cluster(8)
    dims = frozenset({8, 5120, 13824})
    cls = {v: view_class(_view_mesh(cluster, v), dims) for v in
           [(6, 2), (3, 4), (12, 4), (24, 2), (4, 2), (2, 4), (8, 4), (4, 4), (12,), (24,)]}
    # an axis between nodes dividing 13824 only, one within nodes dividing all three
    assert cls[(3, 4)] == cls[(12, 4)]
    assert cls[(6, 2)] == cls[(24, 2)]
    assert cls[(4, 4)] == cls[(8, 4)]          # 16 and 32 divide 5120 and 13824, not 8
    assert cls[(4, 2)] != cls[(4, 4)]          # 8 divides the batch over both axes, 16 not
    assert cls[(12,)] != cls[(3, 4)]
    # the same dims divided, but a node's devices split otherwise: rarely the same optimum
    assert cls[(6, 2)] != cls[(3, 4)]
    assert cls[(4, 2)] != cls[(2, 4)]
    assert cls[(12,)] != cls[(24,)]
    # the same sizes within one node: other links, another class
    assert view_class(_view_mesh(cluster, (2, 2)), dims) != cls[(4, 2)]


def test_the_search_skips_1d_views_of_multi_node_submeshes():
    """Their splits are the 2D view's over both axes (priced cheaper); a node's own 1D view,
    and every 1D view when splits over both axes are not allowed, stay."""
    from torchalpa.passes.pipeline_search.submesh_views import searched_views, view_notes
    dims = frozenset({8, 4096, 5120})
    assert searched_views((5, 4), dims) == [(10, 2), (5, 4)]
    assert searched_views((1, 4), dims) == [(4,), (2, 2)]
    assert searched_views((5, 4), dims, allow_mixed_mesh_shape=False) == [(20,), (10, 2), (5, 4)]
    notes = view_notes([(1, 4), (5, 4), (49, 4)], dims)
    assert len(notes) == 2
    assert "3 logical views skipped because a mesh axis divides no dim" in notes[0]
    assert "(196,), (98, 2), (49, 4)" in notes[0] and "no padding" in notes[0]
    assert "no stage is placed on submesh (49, 4)" in notes[0]
    assert "1 1D views of multi-node submeshes skipped ((20,))" in notes[1]
    assert view_notes([(1, 4)], dims) == []


class _MLP(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))


def _mlp_graph():
    from torchalpa.frontends.torch_export import capture
    with torch.device("meta"):
        model = _MLP()
        x, y = torch.empty(48, 64), torch.empty(48, 64)
    return capture(model, (x, y), F.mse_loss).graph


def test_a_plan_priced_on_its_own_view_keeps_its_estimates():
    """Pricing without the ILP reproduces what the ILP's plan says of itself, and on
    another view of the class gives a whole plan whose lean variant shards every
    parameter and holds less state."""
    from torchalpa.passes.pipeline_search.view_classes import reprice, view_class
    from torchalpa.passes.sharding.intra_op import plan_intra_op
    graph = _mlp_graph()
    cluster = _cluster(8)
    method = torchalpa.ShardParallel()
    small, large = _view_mesh(cluster, (2, 4)), _view_mesh(cluster, (4, 4))
    dims = frozenset(d for node in graph for spec in node.outputs for d in spec.shape)
    assert view_class(small, dims) == view_class(large, dims)
    plan = plan_intra_op(graph, small, method)
    same = reprice(graph, plan, small, method)
    assert same is not None
    for key in ("step_time_s", "model_state_bytes_per_device", "activation_bytes_per_device",
                "saved_activation_bytes_per_device"):
        assert getattr(same.estimates, key) == pytest.approx(getattr(plan.estimates, key))
    moved = reprice(graph, plan, large, method)
    assert moved is not None and moved.mesh_shape == (4, 4)
    assert [s.outputs for s in moved.strategies] == [s.outputs for s in plan.strategies]
    lean_method = torchalpa.ShardParallel(
        auto_sharding_option=torchalpa.AutoShardingOption(parameters="sharded"))
    lean = reprice(graph, plan, large, lean_method, relayout_parameters=True)
    assert lean is not None
    assert all(all(type(p).__name__ == "Shard" for p in v.placements) for v in lean.parameters)
    assert lean.estimates.model_state_bytes_per_device <= \
        moved.estimates.model_state_bytes_per_device


def test_a_plan_with_a_strided_qkv_weight_carries_over():
    """A fused q/k/v projection split by heads holds its weight as a strided shard
    (``passes/sharding/strides.py``); pricing offers those strategies too, so the plan is priced
    on its own view as the ILP priced it, and moves to another view of its class with its
    weight still strided (without them nothing of GPT's attention carried over)."""
    from models import FusedAttention, fused_inputs

    from torchalpa.core.placement import Replicate, Shard, strided
    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.pipeline_search.view_classes import reprice, view_class
    from torchalpa.passes.sharding.intra_op import plan_intra_op
    torch.manual_seed(0)
    graph = capture(FusedAttention(), fused_inputs(), F.mse_loss).graph
    pin = (("c_attn.weight", (Replicate(), strided(0, 3))),
           ("c_proj.weight", (Replicate(), Shard(1))))
    method = torchalpa.ShardParallel(auto_sharding_option=torchalpa.AutoShardingOption(pin=pin))
    cluster = _cluster(8)
    small, large = _view_mesh(cluster, (3, 4)), _view_mesh(cluster, (6, 4))
    dims = frozenset(d for node in graph for spec in node.outputs for d in spec.shape)
    assert view_class(small, dims) == view_class(large, dims)
    plan = plan_intra_op(graph, small, method)
    held = {v.name: v.placements for v in plan.parameters}
    assert held["c_attn.weight"] == (Replicate(), strided(0, 3))
    same = reprice(graph, plan, small, method)
    assert same is not None
    assert same.estimates.step_time_s == pytest.approx(plan.estimates.step_time_s)
    moved = reprice(graph, plan, large, method)
    assert moved is not None
    assert {v.name: v.placements for v in moved.parameters}["c_attn.weight"] == \
        (Replicate(), strided(0, 3))


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [4])
def test_shared_views_plan_what_solving_every_view_plans(nodes):
    """LLaMA-2-13B cut to 2 blocks (its dims: hidden 5120, 40 heads, seq 4096), batch 8 in
    4 micro-batches on ``nodes`` x 4 devices of 32 GB, checkpointed: the search that
    solves one view per class (pricing the plan on the others, lean variants priced from
    the fastest plan) and skips 1D multi-node views chooses the same stages, submeshes and
    views, with the same estimates, as the search that solves every view by ILP."""
    from search_models import checkpointed_llama13b

    from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
    graph, method = checkpointed_llama13b()
    shared = plan_pipeline(graph, _cluster(nodes), method)
    every = plan_pipeline(graph, _cluster(nodes), method, share_views=False)
    assert shared.estimates.layers_repriced > 0
    assert shared.estimates.layer_solves < every.estimates.layer_solves
    assert shared.forward_stage_layer_ids == every.forward_stage_layer_ids
    assert shared.submesh_shapes == every.submesh_shapes
    assert shared.logical_shapes == every.logical_shapes
    assert shared.estimates.step_time_s == pytest.approx(every.estimates.step_time_s)
    assert shared.estimates.memory_per_device_bytes == pytest.approx(
        every.estimates.memory_per_device_bytes)
    assert any("1D views of multi-node submeshes skipped" in n for n in shared.notes)


class _Vocab(nn.Module):
    """An embedding of 48 words, two linear layers, a head: the vocabulary divides by 3,
    no dim of the middle layers does."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(48, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 48)

    def forward(self, ids):
        from torchalpa.ops.markers import mark_pipeline_boundary
        h = self.embed(ids)
        h = mark_pipeline_boundary(h)
        h = F.relu(self.mid(h))
        h = mark_pipeline_boundary(h)
        return self.head(h)


def _vocab_problem():
    """The pipeline search's problem of ``_Vocab`` (3 layers) on 8 nodes of 4 devices."""
    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.pipeline_search.layers import assign_layers
    from torchalpa.passes.pipeline_search.search_problem import SearchProblem
    torch.manual_seed(0)
    ids = torch.randint(0, 48, (8, 16))
    graph = capture(_Vocab(), (ids, torch.randint(0, 48, (8, 16))),
                    lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())).graph
    cluster = _cluster(8)
    method = torchalpa.PipeshardParallel(num_micro_batches=1)
    problem = SearchProblem(graph, assign_layers(graph, method, cluster.num_devices), cluster,
                            method, "global")
    return problem


def test_a_layers_views_are_classed_by_its_own_dims():
    """The vocabulary parts 3 from 5 nodes for the step (3 divides 48, 5 does not), not for
    the middle layer, which holds no dim either divides: its views on 3 and 5 nodes share
    one solve, and that layer's plan solved on 3 nodes is priced on 5 as it is; the
    embedding's layer keeps them apart, and so does the step's class
    (``PassSwitches.layer_classes`` off)."""
    from torchalpa.passes.pipeline_search import layer_costs
    from torchalpa.passes.pipeline_search.layer_cache import SolveCache
    from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
    from torchalpa.passes.pipeline_search.view_classes import reprice
    problem = _vocab_problem()
    assert problem.num_layers == 3
    costs = layer_costs.LayerCosts(problem, SolveCache(), PricingMemo())
    three, five = ((3, 4), (3, 4)), ((5, 4), (5, 4))
    assert 48 in costs.layer_dims(0) and 48 not in costs.layer_dims(1)
    assert costs.view_class(*three, 1) == costs.view_class(*five, 1)
    assert costs.view_class(*three, 0) != costs.view_class(*five, 0)
    assert costs.view_class(*three) != costs.view_class(*five)      # the step's dims
    with PassSwitches.using(layer_classes=False):
        assert costs.view_class(*three, 1) != costs.view_class(*five, 1)
    solved = costs._layer_plan(1, three[0], three[1], False)
    assert solved is not None
    moved = reprice(costs.layer_graph(1), solved, costs._layer_mesh(*five),
                    costs._layer_method(False))
    assert moved is not None and moved.mesh_shape == (5, 4)
    # nothing of the layer divides by 3 or 5: both views replicate over the nodes alike
    own = costs._layer_plan(1, five[0], five[1], False)
    assert own is not None
    assert moved.estimates.step_time_s == pytest.approx(own.estimates.step_time_s)


def test_views_replicating_alike_are_given_their_class_plans_estimates():
    """Views of a layer's class that differ only in axes dividing none of its dims (3 and
    5 nodes for the middle layer) get the solved view's estimates without pricing
    (``PassSwitches.copy_replicated``), and those are the estimates pricing them gives, both variants;
    every other view is priced as before."""
    from torchalpa.passes.pipeline_search import layer_costs
    from torchalpa.passes.pipeline_search.layer_cache import SolveCache
    from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
    from torchalpa.passes.pipeline_search.stages import submesh_shapes
    problem = _vocab_problem()

    def estimates(copy: bool) -> tuple[dict, int]:
        with PassSwitches.using(copy_replicated=copy):
            costs = layer_costs.LayerCosts(problem, SolveCache(), PricingMemo())
            costs.prefetch(submesh_shapes(8, 4), workers=1, max_in_flight=1)
            views = [(v, s) for s in submesh_shapes(8, 4) for v in costs.views(s)]
            return {(l, v, s, lean): costs.layer_estimate(l, v, s, lean)
                    for l in range(problem.num_layers) for v, s in views
                    for lean in (False, True)}, costs.copied

    copied, n = estimates(True)
    priced, none = estimates(False)
    assert n > 0 and none == 0
    assert copied.keys() == priced.keys()
    for key, found in copied.items():
        want = priced[key]
        assert (found is None) == (want is None), key
        if found is not None:
            for field in ("seconds", "state", "activations", "saved"):
                assert getattr(found, field) == pytest.approx(getattr(want, field),
                                                              rel=1e-9), (key, field)
