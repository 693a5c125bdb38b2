"""The run copies of a step's programs (runtime/rewrites/call_overhead.py): fewer Python-dispatched ops,
every value the same bit for bit, the source programs untouched."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
from torchalpa.runtime.rewrites.call_overhead import (
    MAX_CONSTANT_NUMEL,
    cut_call_overhead,
    fold_constants,
    fold_permute_pairs,
)

aten = torch.ops.aten


def calls(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def masked_program(mask_size: int = 16) -> fx.GraphModule:
    """(x, w) -> (where(causal mask, -inf, x @ w.T), the mask): a mask from no input,
    returned too (as a forward returns it, saved for backward), and a transposed pair."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    wt = g.call_function(aten.permute.default, (w, [1, 0]))
    wtt = g.call_function(aten.permute.default, (wt, [1, 0]))     # cancels: w
    wt2 = g.call_function(aten.permute.default, (wtt, [1, 0]))
    y = g.call_function(aten.mm.default, (x, wt2))
    kw = {"device": torch.device("cpu"), "pin_memory": False}
    rows = g.call_function(aten.arange.start_step, (0, mask_size), kw)
    cols = g.call_function(aten.arange.start_step, (0, mask_size), kw)
    diff = g.call_function(aten.sub.Tensor, (
        g.call_function(aten.unsqueeze.default, (rows, -2)),
        g.call_function(aten.unsqueeze.default, (cols, -1))))
    mask = g.call_function(aten.gt.Scalar, (diff, 0))
    neg = g.call_function(aten.scalar_tensor.default, (float("-inf"),), {"dtype": torch.float32})
    out = g.call_function(aten.where.self, (mask, neg, y))
    g.output((out, mask))
    return fx.GraphModule(nn.Module(), g)


def test_the_copy_computes_the_same_values_with_fewer_ops():
    source = masked_program()
    before = list(source.graph.nodes)
    x, w = torch.randn(16, 16), torch.randn(16, 16)
    want = source(x, w)
    fast = cut_call_overhead(source, read_only_from=1)      # the mask: read only
    got = fast(x, w)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert list(source.graph.nodes) == before               # the source is as lowered
    assert "torchalpa_direct_mm_default(" in fast.code      # C++ entries, printable
    assert fast.code.count("_permute_default(") == 1 and "arange" not in fast.code
    assert sum(n.op == "call_function" for n in fast.graph.nodes) == 3   # permute, mm, where


def test_a_returned_constant_stays_computed_unless_read_only():
    gm = masked_program()
    fold_constants(gm)
    gm.recompile()
    assert aten.gt.Scalar in calls(gm)       # the mask is returned: its caller may write
    assert aten.scalar_tensor.default not in calls(gm)


def test_large_constants_stay_computed():
    side = int(MAX_CONSTANT_NUMEL ** 0.5) + 1
    gm = masked_program(side)
    x, w = torch.randn(side, 16), torch.randn(side, 16)     # x @ w.T: (side, side)
    want = gm(x, w)
    fold_constants(gm, read_only_from=1)
    gm.recompile()
    assert aten.sub.Tensor in calls(gm) and aten.gt.Scalar in calls(gm)   # side^2 elements
    assert aten.arange.start_step not in calls(gm)                         # side elements
    assert all(torch.equal(a, b) for a, b in zip(gm(x, w), want))


@pytest.mark.parametrize("q,folds", [([1, 0, 2], 0), ([1, 2, 0], 1)])
def test_only_permute_pairs_that_cancel_are_folded(q, folds):
    g = fx.Graph()
    x = g.placeholder("x")
    inner = g.call_function(aten.permute.default, (x, [2, 0, 1]))
    g.output(g.call_function(aten.permute.default, (inner, q)))
    gm = fx.GraphModule(nn.Module(), g)
    t = torch.randn(2, 3, 4)
    want = gm(t)
    assert fold_permute_pairs(gm.graph) == folds
    gm.recompile()
    assert torch.equal(gm(t), want)


@pytest.mark.usefixtures("single_process_world")
def test_a_causal_attention_step_matches_eager():
    """End to end on one rank: a step with a causal mask trains like eager PyTorch."""
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            a = (q @ k.transpose(-1, -2)) / 4
            a = a.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
            return self.out(a.softmax(-1) @ v)

    torch.manual_seed(0)
    model, ref = Tiny(), Tiny()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                 method=torchalpa.ShardParallel())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        loss = pm.train_step(x, y)
        ref_opt.zero_grad()
        want = F.mse_loss(ref(x), y)
        want.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
    for p, q in zip(pm.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(),  # pyright: ignore[reportAttributeAccessIssue]
                                   rtol=1e-5, atol=1e-6)
