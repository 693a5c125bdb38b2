"""Strided views that are plain reshapes become reshapes (``frontends/restride.py``), so the
planner can split them and the program no longer depends on memory layout."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from torchalpa.frontends.restride import reshape_plain_restrides

aten = torch.ops.aten


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_plain_restrides_become_reshapes_and_compute_the_same():
    def f(x, y):
        a = torch.as_strided(x, (4, 32, 1, 1), (32, 1, 32, 32))      # a restride of size-1 dims
        flat = torch.zeros(128)
        b = torch.as_strided_scatter(flat, y, (4, 32), (32, 1), 0)   # overwrites all of flat
        c = x.new_empty_strided((4, 32), (32, 1)).copy_(y)
        return a * 2, b, c

    x, y = torch.randn(4, 32, 1, 1), torch.randn(4, 32)
    gm = make_fx(f, tracing_mode="fake")(x, y)
    assert aten.as_strided.default in _targets(gm)
    assert reshape_plain_restrides(gm) == 3
    targets = _targets(gm)
    assert not {aten.as_strided.default, aten.as_strided_scatter.default,
                aten.new_empty_strided.default} & set(targets)
    for got, want in zip(gm(x, y), f(x, y)):
        assert torch.equal(got, want)


def test_strides_that_address_memory_are_left_alone():
    def f(x):
        transposed = torch.as_strided(x, (8, 4), (1, 8))             # x.t(): not a reshape
        window = torch.as_strided(x, (3, 4), (8, 1), 2)              # starts 2 elements in
        return transposed, window

    x = torch.randn(4, 8)
    gm = make_fx(f, tracing_mode="fake")(x)
    assert reshape_plain_restrides(gm) == 0
    assert _targets(gm).count(aten.as_strided.default) == 2


class ChannelsLastHead(nn.Module):
    """ConvNeXt's and Swin's ending: a channels-last map permuted back, pooled to 1x1."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):                                  # (B, H, W, C)
        x = self.norm(x).permute(0, 3, 1, 2)              # (B, C, H, W), channels-last strides
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def test_a_channels_last_pool_has_a_rule_for_every_op():
    import torchalpa
    model = ChannelsLastHead()
    batch = (torch.randn(4, 4, 4, 8), torch.randint(3, (4,)))
    plan = torchalpa.plan(model, batch, F.cross_entropy,
                          cluster=torchalpa.Cluster.local_cpu(4),
                          method=torchalpa.ShardParallel(logical_mesh_shape=(4,)))
    assert plan.unsupported_ops == ()
