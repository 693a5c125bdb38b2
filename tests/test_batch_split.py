"""Activations crossing pipeline stages batch-split (``passes/sharding/stage_boundary.py``):
both stages' plans agree on the layout, the sender gathers nothing over the split axis,
stages on different logical meshes send whole, and the stage DP prices the bytes sent.
Planning only (no ranks): ``tests/test_pipeline.py`` trains such a pipeline on 4 gloo
ranks and counts the bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchalpa
from torchalpa.core.plan import OUTPUT

DIM = 64


def _plan(logical, option):
    from models import MLP
    with torch.device("meta"):
        model = MLP(DIM, 4)
    batch = torch.zeros(32, DIM, device="meta"), torch.zeros(32, DIM, device="meta")
    method = torchalpa.PipeshardParallel(
        num_micro_batches=2, layer_option=torchalpa.AutoLayerOption(layer_num=4),
        auto_sharding_option=option,
        stage_option=torchalpa.ManualStageOption(
            forward_stage_layer_ids=((0, 1), (2, 3)), submesh_shapes=((1, 4), (1, 4)),
            logical_shapes=logical))
    return torchalpa.plan(model, batch, F.mse_loss, method=method,
                          cluster=torchalpa.Cluster(num_nodes=2, devices_per_node=4))


def _send_gathers(stage) -> list[int]:
    """Mesh axes the stage's sends are gathered over."""
    return [s.axis for r in stage.plan.reshards if r.consumer == OUTPUT
            and r.slot.kind == "send" for s in r.steps if s.is_collective]


def test_the_batch_crosses_split_over_the_first_axis_of_two_alike_meshes():
    # the batch forced over both axes (as DataParallel does): the send is gathered over
    # the second axis only, the receiver takes its block of the first
    option = torchalpa.AutoShardingOption(force_batch_dim_to_mesh_dim=-1, solver="highs")
    plan = _plan(((2, 2), (2, 2)), option)
    crossing = [t for t in plan.transfers if not t.once_per_step]
    assert crossing and all(t.batch_split == 2 for t in crossing)
    assert all(axis == 1 for s in plan.stages for axis in _send_gathers(s))
    # what a receiving rank is sent: its block (halved again where scatter-gathered)
    assert all(t.bytes_per_receiver() == t.bytes // (2 * t.split) for t in crossing)


def test_stages_on_different_meshes_send_whole():
    option = torchalpa.AutoShardingOption(force_batch_dim_to_mesh_dim=0, solver="highs")
    plan = _plan(((4,), (2, 2)), option)
    crossing = [t for t in plan.transfers if not t.once_per_step]
    assert crossing and all(t.batch_split == 1 for t in crossing)
    # the batch is split over the sender's devices: made whole to be sent
    assert all(_send_gathers(s) for s in plan.stages)


def test_the_stage_dp_prices_the_bytes_sent():
    """The stage DP's send estimate of a middle stage: its boundary values (a batch-first
    activation each way) split over a view's first axis cost 1/4 of a whole send on a
    (4,) view, and on a (1, 4) view (the batch not split) a whole send or its
    scatter-gather, never more."""
    from search_models import exact_stages, small_gpt_graph

    from torchalpa.passes.pipeline_search.layers import assign_layers
    graph = small_gpt_graph()
    cluster = torchalpa.Cluster(num_nodes=2, devices_per_node=4, intra_node_bandwidth=100e9,
                                inter_node_bandwidth=10e9)
    method = torchalpa.PipeshardParallel(
        num_micro_batches=4, layer_option=torchalpa.AutoLayerOption(layer_num=4),
        auto_sharding_option=torchalpa.AutoShardingOption(solver="highs"))
    costs = exact_stages(graph, assign_layers(graph, method, 8), cluster, method).costs
    problem = costs.problem
    whole = costs.send_seconds(1, 2)
    assert whole > 0
    split = costs.send_seconds(1, 2, problem.mesh((1, 4), (4,)))
    assert split == pytest.approx(whole / 4)
    assert costs.send_seconds(1, 2, problem.mesh((1, 4), (1, 4))) <= whole


def test_prefer_reduce_scatter_scatters_each_stages_gradients_not_its_transfers():
    """Alpa's ``prefer_reduce_scatter`` rewrite (``passes/sharding/gradient_scatter.py``)
    runs on each pipeline stage's solve: a stage's data-parallel gradients, all-reduced
    without it, are reduce-scattered (the same tensors and bytes) into parameters stored
    split and gathered in the stage's first read; the activations crossing the stages are
    sent as before."""
    from dataclasses import replace
    base = torchalpa.AutoShardingOption(allow_reduce_scatter=False, solver="highs")
    plain = _plan(((4,), (4,)), base)
    scattered = _plan(((4,), (4,)), replace(base, prefer_reduce_scatter=True))
    assert len(plain.stages) == len(scattered.stages) == 2
    for before, after in zip(plain.stages, scattered.stages):
        reduced = {c.tensor: c.bytes for c in before.plan.collectives
                   if c.kind == "all_reduce" and c.bytes > 4}      # the loss's left out
        assert reduced, before.plan.collectives
        assert {c.tensor: c.bytes for c in after.plan.collectives
                if c.kind == "reduce_scatter"} == reduced
        assert not [c for c in after.plan.collectives if c.kind == "all_reduce" and c.bytes > 4]
        params = {p.node for p in after.plan.parameters}
        assert {c.tensor for c in after.plan.collectives if c.kind == "all_gather"} == params
        assert all(p.placements == (torchalpa.Shard(0),) for p in after.plan.parameters)
        assert all(p.placements == (torchalpa.Replicate(),) for p in before.plan.parameters)

    def sent(plan):
        return [(t.bytes, t.split, t.batch_split, t.once_per_step) for t in plan.transfers]
    assert sent(scattered) == sent(plain) and sent(plain)
