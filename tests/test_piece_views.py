"""``frontends/piece_views.py``: a dim viewed as (pieces, size) and unbound is captured as a
split of the dim (and its backward's stack + view as a cat), and the captured step still
computes the model's loss and gradients."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchalpa.frontends.torch_export import capture


class FusedUnbind(nn.Module):
    """timm's attention projection: ``qkv(x).view(B, S, 3, H).unbind(2)``; ``also_whole``
    reads the (B, S, 3, H) view whole too, so it is more than its pieces."""

    def __init__(self, hidden=8, also_whole=False, cut="unbind"):
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.also_whole, self.cut = also_whole, cut

    def forward(self, x):
        B, S, H = x.shape
        pieces = self.qkv(x).view(B, S, 3, H)                          # (B, S, 3, H)
        if self.cut == "unbind":
            q, k, v = pieces.unbind(2)                                 # (B, S, H) each
        else:                       # indexing, in an order other than the pieces'
            v, q, k = pieces[:, :, 2], pieces[:, :, 0], pieces[:, :, -2]
        out = (q * k).softmax(-1) * v
        return out + pieces.sum(2) if self.also_whole else out


def _check_step(model, x, y):
    c = capture(model, (x, y), F.mse_loss)
    params = [p.detach() for p in model.parameters()]
    out = c.gm(params, [], x, y)
    ref = F.mse_loss(model(x), y)
    ref.backward()
    assert torch.allclose(out[0], ref)
    assert all(torch.allclose(g, p.grad, atol=1e-6) for g, p in zip(out[1:], model.parameters()))
    return [n.op for n in c.graph.ops()]


def test_unbound_pieces_become_a_split_and_a_cat():
    torch.manual_seed(0)
    ops = _check_step(FusedUnbind(), torch.randn(2, 3, 8), torch.randn(2, 3, 8))
    assert "aten.split.Tensor" in ops and "aten.cat.default" in ops
    assert "aten.slice.Tensor" not in ops and "aten.stack.default" not in ops


def test_indexed_pieces_and_their_masked_gradients_become_a_split_and_a_cat():
    """``y[:, :, i]`` traces as ``select``; its backward as ``where(arange(3) == i, g, 0)``
    per piece, summed over the whole view: both are written as the split and the cat."""
    torch.manual_seed(0)
    ops = _check_step(FusedUnbind(cut="index"), torch.randn(2, 3, 8), torch.randn(2, 3, 8))
    assert "aten.split.Tensor" in ops and "aten.cat.default" in ops
    assert "aten.select.int" not in ops and "aten.where.self" not in ops


def test_indexed_pieces_read_whole_too_are_left_alone():
    torch.manual_seed(0)
    ops = _check_step(FusedUnbind(also_whole=True, cut="index"), torch.randn(2, 3, 8),
                      torch.randn(2, 3, 8))
    assert "aten.select.int" in ops


def test_a_view_read_whole_is_left_alone():
    torch.manual_seed(0)
    ops = _check_step(FusedUnbind(also_whole=True), torch.randn(2, 3, 8), torch.randn(2, 3, 8))
    assert "aten.split.Tensor" not in ops and "aten.slice.Tensor" in ops
