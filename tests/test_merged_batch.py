"""``frontends/merged_batch.py``: attention written with ``torch.bmm`` on ``(B * heads, S,
hd)`` views is captured with ``torchalpa::batched_matmul`` over ``(B, heads)``, forward
and backward, and the captured step still computes the model's loss and gradients."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchalpa.frontends.torch_export import capture

B, S, H, NH = 2, 3, 8, 2
D = H // NH


class BmmAttention(nn.Module):
    """Heads merged into the batch by the model: ``view(B * nh, S, hd)`` then ``bmm``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)

    def forward(self, x):
        q, k, v = (t.reshape(B, S, NH, D).transpose(1, 2).reshape(B * NH, S, D)
                   for t in self.qkv(x).split(H, -1))
        scores = torch.bmm(q, k.transpose(1, 2)).view(B, NH, S, S).softmax(-1)
        ctx = torch.bmm(scores.view(B * NH, S, S), v).view(B, NH, S, D)
        return ctx.transpose(1, 2).reshape(B, S, H)


def test_bmm_over_merged_heads_becomes_batched_matmul_and_computes_the_same():
    torch.manual_seed(0)
    model, x, y = BmmAttention(), torch.randn(B, S, H), torch.randn(B, S, H)
    c = capture(model, (x, y), F.mse_loss)
    ops = [n.op for n in c.graph.ops()]
    assert "aten.bmm.default" not in ops
    assert ops.count("torchalpa.batched_matmul.default") == 6      # 2 forward, 4 backward
    out = c.gm([p.detach() for p in model.parameters()], [], x, y)
    ref = F.mse_loss(model(x), y)
    ref.backward()
    assert torch.allclose(out[0], ref)
    assert all(torch.allclose(g, p.grad, atol=1e-6) for g, p in zip(out[1:], model.parameters()))


def test_a_bmm_of_a_true_3d_batch_is_left_alone():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(B, H, H))

        def forward(self, x):                                       # x (B, S, H)
            return torch.bmm(x, self.w)

    torch.manual_seed(0)
    c = capture(Plain(), (torch.randn(B, S, H), torch.randn(B, S, H)), F.mse_loss)
    assert "aten.bmm.default" in [n.op for n in c.graph.ops()]


def test_a_transposed_merged_view_read_elsewhere_still_runs():
    """The transpose moved inside the merge is a reshape: read by something other than a
    bmm, it still runs on the permuted tensor's strides."""
    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(H, H)

        def forward(self, x):                                       # (B, S, H)
            h = self.proj(x).reshape(B, S, NH, D).transpose(1, 2)   # (B, nh, S, hd)
            t = h.reshape(B * NH, S, D).transpose(1, 2)             # (B * nh, hd, S)
            return (t * 2).sum(-1).reshape(B, NH, D).transpose(1, 2).reshape(B, H)

    torch.manual_seed(0)
    model, x, y = Transposed(), torch.randn(B, S, H), torch.randn(B, H)
    c = capture(model, (x, y), F.mse_loss)
    out = c.gm([p.detach() for p in model.parameters()], [], x, y)
    ref = F.mse_loss(model(x), y)
    ref.backward()
    assert torch.allclose(out[0], ref)
    assert all(torch.allclose(g, p.grad, atol=1e-6) for g, p in zip(out[1:], model.parameters()))
