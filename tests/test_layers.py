"""Layer construction: flops-balanced layers cut where the fewest bytes cross."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from test_simplify import Residual

from torchalpa.frontends.torch_export import capture
from torchalpa.passes.layers import cluster_layers


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
