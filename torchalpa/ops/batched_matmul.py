"""``torchalpa::batched_matmul``: a matrix product over several batch dims, as one op.

``torch.matmul`` of two tensors with two or more batch dims (attention written by hand:
``q @ k.transpose(-1, -2)`` on ``(B, heads, S, hd)``) decomposes in ATen to
``expand -> view (B * heads, S, hd) -> bmm -> view``. The merged dim ``B * heads`` can be
split only by its leading factor, so the planner could shard attention by batch but
never by heads (Megatron's layout): every head-parallel plan paid all-to-alls around
each product. The capture (``frontends/opset.py``, ``FusedCalls``) therefore records such
products as this op, which keeps every batch dim its own dim, so each can be sharded
(``passes/rules/matmul.py``). Its body calls ``torch.matmul`` when the program runs;
its gradients are this op again, on transposed operands:

- ``torchalpa::batched_matmul(a (*N, M, K), b (*N, K, P)) -> (*N, M, P)``
  with the same batch dims ``*N`` (at least two) on both operands.

Products that broadcast batch dims, or have one batch dim, stay ATen's (``bmm``/``mm``).
"""

from __future__ import annotations

import torch

__all__ = ["BATCHED_MATMUL_OP", "batched_matmul", "applies"]

BATCHED_MATMUL_OP = "torchalpa.batched_matmul.default"


@torch.library.custom_op("torchalpa::batched_matmul", mutates_args=())
def _batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b).contiguous()


@_batched_matmul.register_fake
def _(a, b):
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad_a = _batched_matmul(grad, b.transpose(-1, -2)) if ctx.needs_input_grad[0] else None
    grad_b = _batched_matmul(a.transpose(-1, -2), grad) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


_batched_matmul.register_autograd(_backward, setup_context=_setup_context)


def applies(a, b) -> bool:
    """Whether ``torch.matmul(a, b)`` is a product this op records: two tensors of one
    dtype with the same two or more batch dims (no broadcasting)."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dim() == b.dim() >= 4 and a.shape[:-2] == b.shape[:-2]
            and a.dtype == b.dtype and a.shape[-1] == b.shape[-2])


def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, b)`` for operands ``applies`` accepts, as the op."""
    return _batched_matmul(a, b)


def flops(a, b, *args, out_val=None, **kwargs) -> int:
    """2 flops per multiply-add, as PyTorch counts ``bmm``."""
    out = 2 * a.shape[-1]
    for size in (*a.shape[:-1], b.shape[-1]):
        out *= size
    return out
