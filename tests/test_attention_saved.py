"""Attention's backward from the forward's saved statistics (runtime/rewrites/attention_statistics.py):
the same gradients as PyTorch's autograd, and the lowering really uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
from torchalpa.ops.attention import sdpa_backward_saved, sdpa_forward_saving


def _inputs(heads_kv=2, mask=None, dtype=torch.float32):
    torch.manual_seed(0)
    q = torch.randn(2, 2, 8, 4, dtype=dtype)
    k, v = (torch.randn(2, heads_kv, 8, 4, dtype=dtype) for _ in range(2))
    if mask == "float":
        mask = torch.randn(2, 1, 1, 8, dtype=dtype)
    elif mask == "bool":
        mask = torch.rand(2, 1, 8, 8) > 0.3
        mask[..., 0] = True                  # no row fully masked
    return q, k, v, mask


@pytest.mark.parametrize("mask,causal,heads_kv", [(None, False, 2), (None, True, 2),
                                                  ("float", False, 2), ("bool", False, 2),
                                                  (None, False, 1)])   # GQA: recomputes
def test_saved_backward_equals_autograd(mask, causal, heads_kv):
    q, k, v, m = _inputs(heads_kv, mask)
    gqa = heads_kv != q.shape[1]
    out, lse = sdpa_forward_saving(q, k, v, m, causal, None, gqa)
    assert (lse.numel() == 0) == gqa              # the fused CPU kernel's statistic
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=m, is_causal=causal, enable_gqa=gqa)
    torch.testing.assert_close(out, ref.detach())
    grad = torch.randn_like(ref)
    ref.backward(grad)
    got = sdpa_backward_saved(grad, q, k, v, m, out, lse, causal, None, gqa)
    for g, leaf in zip(got, leaves):
        torch.testing.assert_close(g, leaf.grad)
        assert g.stride() == leaf.stride()


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x):                                               # (B, T, C)
        q, k, v = self.qkv(x).view(4, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)     # (B, H, T, D)
        return self.out(y.transpose(1, 2).reshape(4, 8, 16))


@pytest.mark.usefixtures("single_process_world")
def test_lowered_step_saves_attention_statistics_and_trains_like_pytorch():
    torch.manual_seed(0)
    model, ref = Attention(), Attention()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, method=torchalpa.ShardParallel())
    code = pm.local_program()
    assert "sdpa_backward_saved" in code and "torchalpa.sdpa_backward" not in code
    loss = pm(x, y)
    loss.backward()
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for p, q in zip(pm.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
