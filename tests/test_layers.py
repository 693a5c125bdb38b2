"""Layer construction: flops-balanced layers cut where the fewest bytes cross."""

from __future__ import annotations

import copy
import re
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from models import MLP
from test_simplify import Residual

from torchalpa.frontends.torch_export import capture
from torchalpa.passes.pipeline_search.layers import cluster_layers


@pytest.fixture(scope="module")
def graph():
    with torch.device("meta"):
        model = Residual(64, 8)
        x, y = torch.empty(32, 64), torch.empty(32, 64)
    return capture(model, (x, y), F.mse_loss).graph


def block_of(node):
    m = re.match(r"layers\.(\d+)", node.module)
    return int(m.group(1)) if m else None


def test_eight_blocks_in_four_layers_cut_between_blocks(graph):
    layer = cluster_layers(graph, 4)
    # every block lies inside one layer, two blocks per layer, in order
    per_block = {}
    for node in graph.ops():
        b = block_of(node)
        if b is not None:
            per_block.setdefault(b, set()).add(layer[node.name])
    assert all(len(v) == 1 for v in per_block.values()), per_block
    assert [per_block[b].pop() for b in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_every_node_has_a_layer_and_backward_follows_forward(graph):
    layer = cluster_layers(graph, 4)
    assert set(layer) == {n.name for n in graph}
    for node in graph.ops():
        b = block_of(node)
        if node.phase == "backward" and b is not None:
            assert layer[node.name] == b // 2, (node.name, node.module)
    # parameters sit with their layer
    for fqn, name in graph.params.items():
        m = re.match(r"layers\.(\d+)", fqn)
        if m:
            assert layer[name] == int(m.group(1)) // 2


def test_flops_are_balanced(graph):
    layer = cluster_layers(graph, 4, eps=0.1)
    flops = Counter()
    for node in graph.ops():
        if node.phase == "forward":
            flops[layer[node.name]] += node.flops
    total = sum(flops.values())
    assert max(flops.values()) <= 1.1 * total / 4 + 1


def test_bad_layer_counts(graph):
    with pytest.raises(ValueError, match="layer_num"):
        cluster_layers(graph, 0)
    with pytest.raises(ValueError, match="only"):
        cluster_layers(graph, 10_000)


def test_gradients_flow_to_earlier_layers(graph):
    """A pipeline can only run if backward values never move to a later layer."""
    layer = cluster_layers(graph, 4)
    for node in graph.ops():
        for ref in node.operands:
            producer = graph.node(ref.node)
            if node.phase == "backward" and producer.phase == "backward" and not producer.is_leaf:
                assert layer[ref.node] >= layer[node.name], (ref.node, node.name)
            if node.phase == "forward" and not producer.is_leaf:
                assert layer[ref.node] <= layer[node.name]


def test_no_layer_is_left_without_work(graph):
    """Cuts inside the loss cost almost no bytes; layers must still carry real flops."""
    layer = cluster_layers(graph, 4)
    flops = Counter()
    for node in graph.ops():
        if node.phase == "forward":
            flops[layer[node.name]] += node.flops
    total = sum(flops.values())
    assert min(flops[l] for l in range(4)) >= 0.4 * total / 4


def test_a_gradient_is_made_in_its_parameters_layer_when_a_cut_splits_its_module():
    """Eight layers of a 4-Linear MLP cut a Linear between its matmul and its bias add: the
    bias gradient is made where the bias lives, so no value flows to a later stage in
    backward (which no schedule can run: it hung on 4 ranks before)."""
    import torchalpa
    from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
    model = torch.nn.Sequential()   # Alpa's quickstart MLP: d -> 4d -> d -> 4d -> d, ReLUs
    model.net = torch.nn.Sequential(*[m for i in range(4) for m in (
        torch.nn.Linear(64, 256) if i % 2 == 0 else torch.nn.Linear(256, 64), torch.nn.ReLU())])
    batch = (torch.randn(1, 64), torch.randn(1, 64))
    graph = capture(model, batch, F.mse_loss).graph
    layers = cluster_layers(graph, 8)
    bias = graph.params["net.2.bias"]
    grad = graph.grads["net.2.bias"].node
    assert layers[grad] == layers[bias]
    method = torchalpa.PipeshardParallel(
        num_micro_batches=4, layer_option=torchalpa.AutoLayerOption(layer_num=8),
        stage_option=torchalpa.ManualStageOption(
            forward_stage_layer_ids=((0,), (1,), (2, 3, 4), (5, 6, 7)),
            submesh_shapes=((1, 1),) * 4))
    plan = plan_pipeline(graph, torchalpa.Cluster.local_cpu(4), method)
    for t in plan.transfers:
        assert (t.dst_stage > t.src_stage) == (t.phase == "forward") or t.once_per_step


def test_a_pipeline_plan_that_no_schedule_can_run_is_refused():
    import dataclasses

    import torchalpa
    from torchalpa.core.plan import PlanError, Transfer
    from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
    graph = capture(MLP(16, 2), (torch.randn(4, 16), torch.randn(4, 16)), F.mse_loss).graph
    method = torchalpa.PipeshardParallel(
        num_micro_batches=2, layer_option=torchalpa.AutoLayerOption(layer_num=2),
        stage_option=torchalpa.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                                 submesh_shapes=((1, 1),) * 2))
    good = plan_pipeline(graph, torchalpa.Cluster.local_cpu(2), method)
    backwards = Transfer("g", 0, src_stage=0, dst_stage=1, phase="backward", bytes=4)
    with pytest.raises(PlanError, match="no schedule can run the plan"):
        dataclasses.replace(good, transfers=good.transfers + (backwards,))


def test_layers_of_a_checkpointed_step_are_cut_between_its_blocks():
    """LLaMA-2-13B cut to 2 blocks, checkpointed, in 2 layers: uncheckpointed, the cheapest
    cut lies inside block 1 (after its attention, where the rotary tables are dead), and
    the recompute of block 1's attention (layer 0) fed that of its MLP half (layer 1): a
    value sent to a later stage in backward, which the 4 x 4 device pipeline plan refused.
    Checkpointed blocks are cut between, so backward only flows to earlier layers."""
    from search_models import checkpointed_llama13b

    from torchalpa.core.opgraph import block_of as block
    from torchalpa.passes.pipeline_search.layers import assign_layers
    graph, method = checkpointed_llama13b()
    assert graph.meta["remat"]["checkpointed"] == (("layers", 0), ("layers", 1))
    layers = assign_layers(graph, method, 16)
    later = [(n.name, c) for n in graph.ops() if n.phase == "backward"
             for c in graph.consumers(n.name) if layers[c] > layers[n.name]]
    assert later == []
    spans = {layers[n.name] for n in graph.ops()
             if n.phase == "forward" and block(n.module) == ("layers", 1)}
    assert spans == {1}
    # the same graph told nothing is checkpointed: the cheapest cut splits block 1
    bare = copy.copy(graph)
    bare.meta = {**graph.meta, "remat": None}
    plain = cluster_layers(bare, 2)
    assert {plain[n.name] for n in graph.ops()
            if n.phase == "forward" and block(n.module) == ("layers", 1)} == {0, 1}


def test_mixed_precision_casts_sit_with_the_blocks_that_read_them():
    """``CastForward`` casts every parameter where forward begins; cut by forward's order
    the casts would all sit in the first layer (it would cast and send every layer's
    weights, and the cuts would drift off balance to send fewer). Each cast joins its
    reader's layer: the blocks are cut as without mixed precision, and the layers of
    identical blocks are identical (one layer ILP serves them)."""
    from torchalpa.passes.pipeline_search.layer_cache import layer_signatures
    from torchalpa.passes.pipeline_search.layers import parameter_ops
    from torchalpa.runtime.execution.precision import CastForward, MixedPrecision
    with torch.device("meta"):
        model = Residual(64, 8)
        x, y = torch.empty(32, 64), torch.empty(32, 64)
    graph = capture(CastForward(model, MixedPrecision(param_dtype=torch.bfloat16)), (x, y),
                    F.mse_loss).graph
    casts = parameter_ops(graph)
    assert len(casts) >= len(graph.params)      # one cast (at least) per parameter
    layer = cluster_layers(graph, 4)
    for name in casts:
        readers = [layer[c] for c in graph.consumers(name)
                   if graph.node(c).phase == "forward"]
        assert layer[name] == min(readers), name
    for fqn, name in graph.params.items():
        m = re.match(r"layers\.(\d+)", fqn)
        if m:
            assert layer[name] == int(m.group(1)) // 2, fqn
    signatures = layer_signatures(graph, layer, 4)
    assert signatures[1] == signatures[2]
