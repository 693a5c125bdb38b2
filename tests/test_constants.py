"""Idioms the frontend must capture like eager autograd computes them: tensors a forward
builds from Python values (``frontends/constants.py``), activation checkpointing (both
``use_reentrant`` modes), and recurrent layers traced without oneDNN-only kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from torchalpa.frontends.constants import MAX_INLINE_ELEMENTS
from torchalpa.frontends.torch_export import CaptureError, capture


def run_captured(c, model, batch):
    """(loss, grads by name) of the captured program on the model's real weights."""
    params = [model.get_parameter(name).detach() for name in c.param_names]
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    buffers = [state[name].detach().clone() for name in c.buffer_names]
    out = c.gm(params, buffers, *batch)
    return out[0], dict(zip(c.param_names, out[1:1 + len(params)]))


def assert_matches_eager(model, batch):
    c = capture(model, batch)
    c.graph.check()
    loss, grads = run_captured(c, model, batch)
    model.zero_grad()
    ref = model(*batch)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    return c


class Constants(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        scale = torch.tensor(2.0)                        # uniform: becomes aten.full
        weights = torch.tensor([1.0, 2.0, 3.0, 4.0])     # values: torchalpa.constant
        empty = torch.tensor([])                         # a KV cache's initial keys
        h = torch.cat([empty, (self.lin(x) / scale * weights).reshape(-1)])
        return h.pow(2).mean()


def test_constants_become_ops_and_compute_like_eager():
    torch.manual_seed(0)
    c = assert_matches_eager(Constants(), (torch.randn(3, 4),))
    assert not [n for n in c.gm.graph.nodes if n.op == "get_attr"]
    ops = {n.op for n in c.graph.ops()}
    assert {"aten.full.default", "torchalpa.constant.default",
            "aten.empty.memory_format"} <= ops


def test_a_large_constant_names_the_line_and_asks_for_a_buffer():
    class Large(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            table = torch.tensor([float(i) for i in range(MAX_INLINE_ELEMENTS + 4)])
            return (self.lin(x).sum() * table).sum()

    with pytest.raises(CaptureError, match=r"register_buffer.*") as e:
        capture(Large(), (torch.randn(2, 4),))
    assert "test_constants.py" in str(e.value)


class Checkpointed(nn.Module):
    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = self.embed(x)
        h = checkpoint(self.block, h, use_reentrant=self.use_reentrant)
        return self.head(h).pow(2).mean()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_regions_recompute_in_backward(use_reentrant):
    torch.manual_seed(0)
    model = Checkpointed(use_reentrant)
    c = assert_matches_eager(model, (torch.randn(5, 4),))
    # the planner sees the recompute: block.0's matmul runs in forward and again in backward
    forward = [n for n in c.graph.ops() if n.op == "aten.mm.default" and n.module == "block.0"]
    assert {n.phase for n in forward} == {"forward", "backward"}
    assert len(forward) >= 3          # forward, recompute, grad of input (+ weight)


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN])
def test_recurrent_layers_capture_without_onednn_kernels(cell):
    torch.manual_seed(0)

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = cell(4, 6, num_layers=2, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0].pow(2).mean()

    c = assert_matches_eager(Recurrent(), (torch.randn(2, 3, 4),))
    assert not [n.op for n in c.graph.ops() if "mkldnn" in n.op]
