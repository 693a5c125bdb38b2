"""The torch frontend: joint graphs on fake tensors, module paths, phases, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import MLP
from torchalpa.frontends.torch_export import CaptureError, capture, split_inputs


def meta_mlp(batch=8, hidden=16, layers=3):
    with torch.device("meta"):
        return MLP(hidden, layers), torch.empty(batch, hidden), torch.empty(batch, hidden)


def test_joint_graph_of_an_mlp():
    model, x, y = meta_mlp()
    c = capture(model, (x, y), F.mse_loss)
    g = c.graph
    g.check()
    assert list(g.params) == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias",
                              "net.4.weight", "net.4.bias"]
    assert len(g.inputs) == 2
    # every trainable parameter has a gradient output of its own shape
    for fqn, ref in g.grads.items():
        assert g.spec(ref).shape == g.node(g.params[fqn]).output.shape
    ops = list(g.ops())
    # 3 forward matmuls and 5 backward ones (no gradient for the input)
    mms = [n for n in ops if n.op == "aten.mm.default"]
    assert [n.phase for n in mms].count("forward") == 3
    assert [n.phase for n in mms].count("backward") == 5
    assert sum(n.flops for n in mms) == 8 * 2 * 8 * 16 * 16
    # forward and backward ops know the module the user wrote
    assert {n.module for n in mms} == {"net.0", "net.2", "net.4"}
    loss = g.node(g.outputs.loss.node)
    assert loss.phase == "forward" and g.spec(g.outputs.loss).shape == ()


def test_capture_reads_no_weights():
    """A model on meta (no storage at all) captures; fingerprints are stable."""
    model, x, y = meta_mlp()
    a = capture(model, (x, y), F.mse_loss).graph.fingerprint()
    b = capture(model, (x, y), F.mse_loss).graph.fingerprint()
    assert a == b
    model2, x2, y2 = meta_mlp(batch=16)
    assert capture(model2, (x2, y2), F.mse_loss).graph.fingerprint() != a


def test_split_inputs_by_loss_signature():
    def two_targets(out, y, w):
        return ((out - y) ** 2 * w).mean()
    assert split_inputs((1, 2, 3, 4), two_targets) == ((1, 2), (3, 4))
    assert split_inputs((1, 2), F.mse_loss) == ((1,), (2,))
    assert split_inputs((1, 2), None) == ((1, 2), ())
    with pytest.raises(ValueError, match="target"):
        split_inputs((1,), F.mse_loss)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:          # depends on tensor values
            h = h * 2
        return h


def test_data_dependent_control_flow_names_the_problem():
    with pytest.raises(CaptureError, match="control flow depends on tensor values"):
        capture(DataDependent(), (torch.randn(2, 4), torch.randn(2, 4)), F.mse_loss)


def test_non_scalar_loss_is_rejected_with_a_fix():
    model, x, _ = meta_mlp()
    with pytest.raises(CaptureError, match="scalar loss"):
        capture(model, (x,), None)


def test_model_returning_loss_needs_no_loss_fn():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = MLP(8, 2)

        def forward(self, x, y):
            return F.mse_loss(self.m(x), y)

    c = capture(WithLoss(), (torch.randn(4, 8), torch.randn(4, 8)))
    assert len(c.graph.inputs) == 2 and len(c.graph.params) == 4
    assert {n.module for n in c.graph.ops() if n.op == "aten.mm.default"} == {"m.net.0", "m.net.2"}


def test_frozen_parameters_are_not_trained():
    model, x, y = meta_mlp()
    model.net[0].weight.requires_grad_(False)
    c = capture(model, (x, y), F.mse_loss)
    assert "net.0.weight" not in c.graph.params
    assert "net.0.weight" in c.buffer_names
