"""``torchalpa::cross_entropy``: a fused cross-entropy that keeps no float32 log-probabilities.

Eager ``F.cross_entropy`` is ``log_softmax`` then ``nll_loss``: forward keeps the
log-probabilities (tokens x vocabulary, float32 under autocast) for backward, and backward
makes two more tensors of that size (the target's scattered gradient and the softmax
gradient) before casting to the logits' dtype. On a language model's head that is the
step's peak. Fused kernels (flash-attn's cross-entropy, which llm-foundry trains MPT with;
Liger's; a chunked loss) instead keep the logits they are given and one float32
log-sum-exp per token, and write the logits' gradient in the logits' dtype.

These ops do the same, chunked over tokens so that no float32 tokens x vocabulary tensor
lives whole (at most ``chunk_rows(V)`` rows of float32 at a time):

- ``torchalpa::cross_entropy(logits (N, V), targets (N,), ignore_index, label_smoothing)
  -> (losses (N,) float32, lse (N,) float32)``: each token's loss (0 where the target is
  ``ignore_index``) and its log-sum-exp over the vocabulary, which backward reads;
- ``torchalpa::cross_entropy_backward(grad_losses (N,), logits, targets, lse,
  ignore_index, label_smoothing) -> grad_logits (N, V)`` in the logits' dtype:
  ``(softmax(x) - (1 - eps) onehot(t) - eps / V) * grad`` per row, rows of ignored
  targets zero.

With label smoothing ``eps`` the loss is ``(1 - eps) (lse - x_t) + eps (lse - mean(x))``,
as ``F.cross_entropy`` defines it. The per-token losses keep the op free along tokens (a
sharding rule splits them freely); ``cross_entropy`` reduces them with ordinary ops
(a sum, and for the mean the count of targets that are not ignored), so a mean over tokens
split across devices is summed whole. What these ops do not take (class weights,
probability targets, other reductions than mean / sum / none, integer logits) falls back
to ``F.cross_entropy``.

The transient each call makes (``transient_bytes``): forward a float32 chunk of the logits
and its exponentials; backward one float32 chunk, scaled in place then written into the
gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["cross_entropy", "CROSS_ENTROPY_OP", "CROSS_ENTROPY_BACKWARD_OP", "CHUNK_ELEMENTS",
           "chunk_rows", "transient_bytes", "forward_flops", "backward_flops"]

CROSS_ENTROPY_OP = "torchalpa.cross_entropy.default"
CROSS_ENTROPY_BACKWARD_OP = "torchalpa.cross_entropy_backward.default"

CHUNK_ELEMENTS = 1 << 24
"""Float32 elements of one chunk (64 MiB): rows of the vocabulary computed at a time."""

_FORWARD_CHUNKS = 2    # a chunk upcast to float32, and its exponentials (logsumexp)
_BACKWARD_CHUNKS = 1   # a chunk upcast to float32, made the gradient in place


def chunk_rows(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab`` entries (at least one)."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def transient_bytes(tokens: int, vocab: int, backward: bool) -> int:
    """Bytes one call holds beside its operands and results: float32 chunks of rows."""
    rows = min(tokens, chunk_rows(vocab))
    return rows * vocab * 4 * (_BACKWARD_CHUNKS if backward else _FORWARD_CHUNKS)


def forward_flops(tokens: int, vocab: int) -> int:
    """Max, subtract, exp, sum per entry (and the mean for label smoothing, counted)."""
    return 5 * tokens * vocab


def backward_flops(tokens: int, vocab: int) -> int:
    """Subtract, exp, the smoothing and target terms, times the gradient per entry."""
    return 4 * tokens * vocab


def _row_terms(x: torch.Tensor, targets: torch.Tensor, ignore_index: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets with ignored ones replaced by 0, whether each row counts)."""
    kept = targets != ignore_index
    return torch.where(kept, targets, torch.zeros_like(targets)), kept


@torch.library.custom_op("torchalpa::cross_entropy", mutates_args=())
def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                   label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, vocab = logits.shape
    losses = logits.new_empty((tokens,), dtype=torch.float32)
    lse = logits.new_empty((tokens,), dtype=torch.float32)
    safe, kept = _row_terms(logits, targets, ignore_index)
    step = chunk_rows(vocab)
    for start in range(0, tokens, step):
        rows = slice(start, start + step)
        x = logits[rows].float()                                   # (n, V) float32
        chunk_lse = torch.logsumexp(x, dim=-1)                     # (n,)
        picked = x.gather(1, safe[rows, None]).squeeze(1)          # (n,)
        loss = chunk_lse - picked
        if label_smoothing:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (chunk_lse - x.mean(-1))
        lse[rows] = chunk_lse
        losses[rows] = torch.where(kept[rows], loss, torch.zeros_like(loss))
    return losses, lse


@_cross_entropy.register_fake
def _(logits, targets, ignore_index, label_smoothing):
    tokens = logits.shape[0]
    return (logits.new_empty((tokens,), dtype=torch.float32),
            logits.new_empty((tokens,), dtype=torch.float32))


@torch.library.custom_op("torchalpa::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward(grad_losses: torch.Tensor, logits: torch.Tensor,
                            targets: torch.Tensor, lse: torch.Tensor, ignore_index: int,
                            label_smoothing: float) -> torch.Tensor:
    tokens, vocab = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    safe, kept = _row_terms(logits, targets, ignore_index)
    scale = torch.where(kept, grad_losses.float(), torch.zeros_like(lse))   # (N,)
    step = chunk_rows(vocab)
    for start in range(0, tokens, step):
        rows = slice(start, start + step)
        p = logits[rows].to(torch.float32, copy=True)              # (n, V), never the logits
        p.sub_(lse[rows, None]).exp_()                             # softmax
        if label_smoothing:
            p.sub_(label_smoothing / vocab)
        p.scatter_add_(1, safe[rows, None],
                       torch.full_like(lse[rows, None], label_smoothing - 1.0))
        grad[rows] = p.mul_(scale[rows, None])
    return grad


@_cross_entropy_backward.register_fake
def _(grad_losses, logits, targets, lse, ignore_index, label_smoothing):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, targets, ignore_index, label_smoothing = inputs
    _, lse = output
    ctx.save_for_backward(logits, targets, lse)
    ctx.mark_non_differentiable(lse)
    ctx.options = (ignore_index, label_smoothing)


def _backward(ctx, grad_losses, _grad_lse):
    logits, targets, lse = ctx.saved_tensors
    grad = _cross_entropy_backward(grad_losses, logits, targets, lse, *ctx.options)
    return grad, None, None, None


_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


def _fused_applies(logits: torch.Tensor, targets: torch.Tensor, weight, reduction: str) -> bool:
    return (weight is None and reduction in ("mean", "sum", "none")
            and logits.is_floating_point() and logits.dim() >= 2
            and not targets.is_floating_point() and targets.shape == logits.shape[:-1])


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                  weight: torch.Tensor | None = None, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy(logits, targets, ...)`` over the last dim of ``logits``
    ``(..., V)`` with class-index ``targets`` ``(...)``, as the fused op; the result in
    the logits' dtype, as ``F.cross_entropy``'s. Class weights, probability targets and
    other layouts fall back to ``F.cross_entropy`` (class dim last here, not dim 1)."""
    if not _fused_applies(logits, targets, weight, reduction):
        flat = logits.reshape(-1, logits.shape[-1])
        loss = F.cross_entropy(flat, targets.reshape(-1) if not targets.is_floating_point()
                               else targets.reshape(flat.shape), weight=weight,
                               ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
        return loss.reshape(targets.shape) if reduction == "none" else loss
    flat = logits.reshape(-1, logits.shape[-1])                      # (N, V)
    losses, _ = _cross_entropy(flat, targets.reshape(-1), int(ignore_index),
                               float(label_smoothing))               # (N,) float32
    if reduction == "none":
        return losses.reshape(targets.shape).to(logits.dtype)
    total = losses.sum()
    if reduction == "mean":
        total = total / (targets != ignore_index).sum()
    return total.to(logits.dtype)
