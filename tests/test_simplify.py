"""Follower merging and repeated-layer sharing shrink the ILP without changing the answer
much: the number of decisions stops growing with depth, and layers get one layout."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchalpa import AutoShardingOption, ShardParallel
from torchalpa.core.cluster import Cluster
from torchalpa.frontends.torch_export import capture
from torchalpa.passes.sharding.intra_op import build_strategies, plan_intra_op
from torchalpa.passes.sharding.simplify import group_nodes


class Residual(nn.Module):
    def __init__(self, h, num_layers):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(h, 2 * h), nn.ReLU(), nn.Linear(2 * h, h))
            for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def graph_and_blocks(num_layers, h=64, b=32):
    with torch.device("meta"):
        model = Residual(h, num_layers)
        x, y = torch.empty(b, h), torch.empty(b, h)
    g = capture(model, (x, y), F.mse_loss).graph
    params = {v: k for k, v in g.params.items()}
    blocks = {}
    for n in g:
        m = re.match(r"layers\.(\d+)", n.module or params.get(n.name, ""))
        if m:
            blocks[n.name] = ("layers", int(m.group(1)))
    return g, blocks


MESH = Cluster.h100(num_nodes=1).logical_mesh((2, 4))


def test_followers_take_their_operands_decision():
    g, _ = graph_and_blocks(2)
    S = build_strategies(g, MESH).strategies
    grouping = group_nodes(g, S)
    relus = [n for n in g.ops() if n.op == "aten.relu.default"]
    assert relus and all(grouping.rep[n.name] != n.name for n in relus)
    # a follower reads its operand's layout as is, for every choice of the representative
    for n in relus:
        ref = n.operands[0]
        for a, b in enumerate(grouping.index[n.name]):
            src = S[ref.node][grouping.index[ref.node][a]].outputs[ref.index]
            assert S[n.name][b].inputs[0] == src


def test_decisions_do_not_grow_with_depth():
    counts = []
    for depth in (3, 6):
        g, blocks = graph_and_blocks(depth)
        # the simplified problem alone (small graphs are otherwise also solved in full)
        simplified = ShardParallel(auto_sharding_option=AutoShardingOption(exact_below=0))
        plan = plan_intra_op(g, MESH, simplified, blocks=blocks)
        counts.append(plan.estimates["num_decisions"])
        # every repeated layer got the same layouts
        layouts = {}
        for p in plan.parameters:
            key = re.sub(r"layers\.\d+\.", "layers.*.", p.name)
            layouts.setdefault(key, set()).add(p.placements)
        middle = {k: v for k, v in layouts.items() if k.startswith("layers.*.")}
        assert all(len(v) <= 2 for v in middle.values())   # the first layer may differ
    assert counts[0] == counts[1]


def test_sharing_costs_little():
    g, blocks = graph_and_blocks(4)
    shared = plan_intra_op(g, MESH, blocks=blocks).estimates["objective"]
    free = plan_intra_op(g, MESH).estimates["objective"]
    assert free <= shared * (1 + 1e-9)
    assert shared <= free * 1.05


def _mlp_of_repeated_linears():
    """A 6-Linear MLP whose Linears are each a repeated block, on a (4,) mesh: (graph,
    blocks, mesh)."""
    from models import MLP

    from torchalpa.core.cluster import LogicalMesh
    from torchalpa.frontends.repeated import find_repeated_blocks
    with torch.device("meta"):
        model = MLP(256, 6)
        x, y = torch.empty(32, 256), torch.empty(32, 256)
    g = capture(model, (x, y), F.mse_loss).graph
    return g, find_repeated_blocks(g), LogicalMesh(shape=(4,))


def test_identical_linear_layers_can_still_alternate():
    """When every Linear of an MLP is its own repeated block, sharing one decision would
    forbid Megatron's column/row alternation; the planner notices and lets layers differ."""
    from torchalpa.passes.pricing.cost import all_reduce_cost
    g, blocks, mesh = _mlp_of_repeated_linears()
    assert blocks, "the Linear layers are repeated blocks"
    plan = plan_intra_op(g, mesh, blocks=blocks)
    assert plan.estimates["objective"] == pytest.approx(5 * all_reduce_cost(mesh, 32 * 256 * 4, 0))


def test_alternating_solve_can_be_turned_off():
    """``alternate_blocks=False`` (the pipeline search's per-layer estimates) keeps the
    shared decision: every Linear of the MLP takes one layout, so the plan pays more than
    the alternating one above."""
    from torchalpa.core.options import AutoShardingOption, ShardParallel
    g, blocks, mesh = _mlp_of_repeated_linears()

    def objective(**option):    # no unsimplified re-solve, which would find it anyway
        method = ShardParallel(auto_sharding_option=AutoShardingOption(
            exact_below=0, free_followers_below=0, **option))
        return plan_intra_op(g, mesh, method, blocks=blocks).estimates["objective"]

    assert objective(alternate_blocks=False) > objective() * 1.01
