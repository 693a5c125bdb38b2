"""Work done once for a transformer's identical layers and reused by the others must never
reach a layer that differs: layers of another width are priced, held in memory and planned
as if nothing had been planned before."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchalpa import AutoShardingOption, ShardParallel
from torchalpa.core.cluster import Cluster
from torchalpa.frontends.torch_export import capture
from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
from torchalpa.passes.pricing import memory
from torchalpa.passes.sharding import costgraph
from torchalpa.passes.sharding.intra_op import build_strategies, plan_intra_op

MESH = Cluster.h100(num_nodes=1).logical_mesh((2, 4))
FUSED = replace(MESH, eager_kernels=False)
"""The mesh as a compiled step's plan sees it: eager and fused pricing differ in the graph
(its ops' bytes) alone."""


class Layers(nn.Module):
    """Residual MLP layers of the given inner widths."""

    def __init__(self, h, widths):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(h, w), nn.ReLU(), nn.Linear(w, h)) for w in widths)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _graph(widths, h=64, b=32):
    with torch.device("meta"):
        model = Layers(h, widths)
        x, y = torch.empty(b, h), torch.empty(b, h)
    return capture(model, (x, y), F.mse_loss).graph


def _blocks(graph):
    blocks = {}
    for n in graph:
        parts = (n.module or "").split(".")
        if len(parts) > 1 and parts[0] == "layers":
            blocks[n.name] = ("layers", int(parts[1]))
    return blocks


def _forget_alike_work():
    """Empty the memos that outlive one graph (those keyed by a graph go with it)."""
    costgraph._ALIKE_COSTS.clear()
    costgraph._COMPUTE_BY_MESH.clear()
    costgraph._LAST_COMPUTE_MESH.clear()


def _plan_json(graph, elementwise="eager", memo=None):
    method = ShardParallel(auto_sharding_option=AutoShardingOption(elementwise=elementwise))
    plan = plan_intra_op(graph, FUSED, method, blocks=_blocks(graph), memo=memo)
    d = json.loads(plan.to_json())
    d.pop("notes", None)
    d["estimates"] = {k: v for k, v in d["estimates"].items() if "second" not in k}
    return d


def test_layers_that_differ_are_planned_as_if_alone():
    """One pricing memo across plans, as a search keeps it (the rules' strategies shared,
    so nodes alike in every other graph find their prices): a model of identical layers,
    then one whose second layer is wider, eagerly and then priced as a compiled step runs
    it (the same mesh and rules, other bytes per op). Each plan and its estimates equal those made
    with nothing kept."""
    size = {"h": 1024, "b": 4096}
    same, differ = _graph([4096, 4096], **size), _graph([4096, 8192], **size)
    alone = {}
    for graph, mode in ((same, "eager"), (differ, "eager"), (differ, "fused")):
        _forget_alike_work()
        alone[id(graph), mode] = _plan_json(graph, mode)
    _forget_alike_work()
    memo = PricingMemo()
    for graph, mode in ((same, "eager"), (differ, "eager"), (differ, "fused")):
        assert _plan_json(graph, mode, memo) == alone[id(graph), mode], (mode, id(graph))


def test_nodes_alike_share_one_price_and_others_do_not():
    """The same op of two identical layers is priced once (one array); the op of a layer
    of another width gets its own price."""
    g = _graph([4096, 4096, 8192], h=1024, b=4096)     # large enough to cost more than a launch
    S = build_strategies(g, MESH).strategies
    mms = [n for n in g.ops() if n.op == "aten.mm.default" and n.phase == "forward"]
    first, second, wide = mms[0], mms[2], mms[4]       # up-projections of layers 0, 1, 2
    assert first.module.startswith("layers.0") and wide.module.startswith("layers.2")
    price = {n.name: costgraph._own_costs(g, MESH, n, S[n.name])
             for n in (first, second, wide)}
    assert price[first.name] is price[second.name]
    assert costgraph._alike(g, first) is costgraph._alike(g, second)
    assert costgraph._alike(g, first) != costgraph._alike(g, wide)
    assert not np.array_equal(price[first.name], price[wide.name])


def test_liveness_is_kept_per_question():
    """The intervals of one graph are made once per set of arguments: another question
    (gradients held from backward) gets its own answer, read-only."""
    g = _graph([128, 256])
    a = memory.liveness(g)
    assert memory.liveness(g) is a
    late = memory.liveness(g, grads_from_backward=True)
    assert late is not a and len(late.names) > len(a.names)
    assert not a.start.flags.writeable and not a.end.flags.writeable


def test_entry_bytes_match_each_value_priced_alone():
    """The bytes of each value of a plan, priced once per alike value, equal each value's
    own ``value_bytes`` (layers of two widths: values alike and not)."""
    g = _graph([128, 128, 256])
    S = build_strategies(g, MESH).strategies
    live = memory.liveness(g)
    for pick in (0, -1):
        outputs = {name: s[pick].outputs for name, s in S.items()}
        sizes = memory._entry_bytes(g, live, outputs, MESH.shape, {})
        alone = [memory.value_bytes(g, name, outputs[name], MESH.shape, {}, k)
                 for name, k in live.entries()]
        assert sizes.tolist() == alone
