"""The device-neutral attention op ``torchalpa::sdpa`` (torchalpa/ops/attention.py).

It must compute what ``F.scaled_dot_product_attention`` computes, forward and backward
(a learned additive bias included), and a model that uses it must train under torchalpa
like eager PyTorch. Its sharding rules are checked with every other rule in test_rules.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import torchalpa
from torchalpa.frontends.torch_export import capture
from torchalpa.ops.attention import sdpa

pytestmark = pytest.mark.usefixtures("single_process_world")   # conftest.py


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


@pytest.mark.parametrize("kind", ["plain", "causal_gqa", "bool_mask", "learned_bias"])
def test_op_matches_pytorch_forward_and_backward(kind):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 6)
    call = {}
    if kind == "plain":
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    elif kind == "causal_gqa":
        call = dict(is_causal=True, enable_gqa=True)
        k, v = k[:, :, :5], v[:, :, :5]
    elif kind == "bool_mask":
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        call = dict(attn_mask=torch.rand(2, 1, 1, 7) > 0.3)
    else:
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        call = dict(attn_mask=torch.randn(4, 5, 7))          # broadcast over the batch
    mask = call.pop("attn_mask", None)
    ours = _leaves(q, k, v, *([mask] if mask is not None else []))
    ref = _leaves(q, k, v, *([mask] if mask is not None else []))
    out = sdpa(*ours[:3], attn_mask=ours[3] if mask is not None else None, **call)
    want = F.scaled_dot_product_attention(*ref[:3], attn_mask=ref[3] if mask is not None
                                          else None, **call)
    assert out.shape == want.shape == (2, 4, 5, 6)
    torch.testing.assert_close(out, want)
    grad = torch.randn_like(want)
    out.backward(grad)
    want.backward(grad)
    for a, b in zip(ours, ref):
        if b.requires_grad:
            assert a.grad is not None and a.grad.shape == b.shape
            torch.testing.assert_close(a.grad, b.grad)


class _Passthrough(TorchDispatchMode):
    """Like the runtime's collective counter: sees every op, changes nothing."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_backward_op_runs_under_a_dispatch_mode():
    """The backward recomputes attention under autograd inside the op's body; that must
    work where a dispatch mode watches the ops (the runtime counts collectives so)."""
    torch.manual_seed(0)
    q, k, v, bias = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8), \
        torch.randn(2, 4, 4)
    grad = torch.randn(2, 2, 4, 8)
    with _Passthrough() as mode:
        got = torch.ops.torchalpa.sdpa_bias_backward(grad, q, k, v, bias, False, None, False)
    assert mode.ops == ["torchalpa.sdpa_bias_backward.default"]
    ref = _leaves(q, k, v, bias)
    F.scaled_dot_product_attention(*ref[:3], attn_mask=ref[3]).backward(grad)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r.grad)


class BiasedAttention(nn.Module):
    """Self-attention with a learned additive bias per head and position pair (T5-style)."""

    def __init__(self, dim=16, heads=2, length=8):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.bias = nn.Parameter(torch.randn(heads, length, length) * 0.1)   # (H, T, T)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):                                                    # (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)    # (B, H, T, D)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


def test_learned_bias_is_captured_with_its_gradient():
    with torch.device("meta"):
        model, x, y = BiasedAttention(), torch.empty(4, 8, 16), torch.empty(4, 8, 16)
    step = capture(model, (x, y), F.mse_loss)
    ops = [n.op for n in step.graph.ops()]
    assert "torchalpa.sdpa.default" in ops and "torchalpa.sdpa_bias_backward.default" in ops
    assert not any("_for_cpu" in op for op in ops)
    assert dict(step.graph.outputs.grads).keys() >= {"bias"}


class CheckpointedAttention(BiasedAttention):
    """The same layer run under ``torch.utils.checkpoint`` (as HF's
    ``gradient_checkpointing_enable()`` runs its decoder layers)."""

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


def test_attention_recomputed_by_checkpoint_is_the_neutral_op_too():
    """Torch-function modes are off while checkpoint recomputes in backward; the recompute
    must still record ``torchalpa::sdpa`` (else its metadata check fails, or a CPU kernel
    lands in the program)."""
    with torch.device("meta"):
        model, x, y = CheckpointedAttention(), torch.empty(4, 8, 16), torch.empty(4, 8, 16)
    ops = [n.op for n in capture(model, (x, y), F.mse_loss).graph.ops()]
    assert ops.count("torchalpa.sdpa.default") == 2          # forward, and its recompute
    assert not any("scaled_dot_product" in op for op in ops)
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_learned_bias_trains_like_pytorch():
    torch.manual_seed(0)
    model = BiasedAttention()
    torch.manual_seed(0)
    ref = BiasedAttention()
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, method=torchalpa.ShardParallel())
    loss = pm(x, y)
    loss.backward()
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert ref.bias.grad.abs().sum() > 0
    for p, q in zip(pm.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
