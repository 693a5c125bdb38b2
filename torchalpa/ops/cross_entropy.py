"""``torchalpa::cross_entropy``: a fused cross-entropy that keeps no float32 log-probabilities.

Eager ``F.cross_entropy`` is ``log_softmax`` then ``nll_loss``: forward keeps the
log-probabilities (tokens x vocabulary, float32 under autocast) for backward, and backward
makes two more tensors of that size (the target's scattered gradient and the softmax
gradient) before casting to the logits' dtype. On a language model's head that is the
step's peak. Fused kernels (flash-attn's cross-entropy, which llm-foundry trains MPT with;
Liger's; a chunked loss) instead keep the logits they are given and one float32
log-sum-exp per token, and write the logits' gradient in the logits' dtype.

These ops do the same, chunked over tokens so that no float32 tokens x vocabulary tensor
lives whole (``chunk_rows(V)`` rows at a time, 16 MiB of float32):

- ``torchalpa::cross_entropy(logits (N, V), targets (N,), ignore_index, label_smoothing)
  -> (losses (N,), lse (N,))`` in float32 (float64 for float64 logits): each token's
  loss (0 where the target is ``ignore_index``) and its log-sum-exp over the
  vocabulary, which backward reads;
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

Split by vocabulary (Megatron-LM's ``vocab_parallel_cross_entropy``, torch's
``loss_parallel``): the planner may keep the logits split along ``V`` (a head split by
vocabulary then never gathers them). Forward then runs as three per-token statistics of
this device's block of columns, each all-reduced over the devices splitting ``V``
(``runtime/lowering/synced.py``; the rule's ``synced`` factor prices them): ``block_max``
(max), ``block_sum_exp`` (sum of ``exp(x - max)``), ``block_linear`` (sum of
``(1 - eps) x_t``, zero where another block owns the target, plus ``eps sum(x) / V``);
``block_finish`` makes ``lse = max + log(sum)`` and ``loss = lse - linear``, whole on
every device of the split. Backward is ``backward_block`` on the block: local given the
whole rows' ``lse`` (the target's term only where the block owns it, the smoothing over
the whole ``V``). The split forward reads its block three times (one pass per statistic)
where the whole op reads the logits once; priced as one read, as the fused kernel.
What is missing: the three statistics are three all-reduces of one float per token
where the last two could be one of two floats (``SyncedOp`` all-reduces each statistic
as it is made), and the three passes over the block are priced as one.

The transient each call makes (``transient_bytes``): forward a chunk of exponentials (and
of upcast logits, for bf16 / fp16 logits); backward nothing for float32 logits (each chunk
is computed in the gradient's own rows), else one float32 chunk. The planner's memory
model does not count it: at most 16 MiB in backward, 32 MiB in forward, beside the
tokens x vocabulary values it does count.

Priced (flops: ``forward_flops`` / ``backward_flops`` in ``frontends/opset.py``; bytes as
captured: the logits read once in forward, read once and their gradient written once in
backward) as a fused kernel moves them: flash-attn's, which the published MPT runs ran.
The bodies here are PyTorch ops per chunk, which on a GPU write and read the float32
chunk at each step (about ten times those bytes): a GPU step running them spends more on
the loss than priced, until a fused kernel (Triton, ``torch.compile`` of the chunk)
replaces the bodies. On CPU ranks they are what runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["cross_entropy", "CROSS_ENTROPY_OP", "CROSS_ENTROPY_BACKWARD_OP", "CHUNK_ELEMENTS",
           "accumulate_dtype", "chunk_rows", "transient_bytes", "forward_flops",
           "backward_flops", "backward_block", "block_max", "block_sum_exp", "block_linear",
           "block_finish"]

CROSS_ENTROPY_OP = "torchalpa.cross_entropy.default"
CROSS_ENTROPY_BACKWARD_OP = "torchalpa.cross_entropy_backward.default"

CHUNK_ELEMENTS = 1 << 22
"""Float32 elements of one chunk (16 MiB): rows of the vocabulary computed at a time."""


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the op computes in: float32, or float64 for float64 logits."""
    return torch.promote_types(dtype, torch.float32)


def chunk_rows(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab`` entries (at least one)."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def transient_bytes(tokens: int, vocab: int, dtype: torch.dtype, backward: bool) -> int:
    """Bytes one call holds beside its operands and results, for logits of ``dtype``:
    forward a chunk of exponentials (and the chunk upcast, for logits in a lower
    precision); backward nothing for logits in the accumulating dtype (each chunk is
    computed in the gradient's own rows), else one chunk upcast."""
    acc = accumulate_dtype(dtype)
    chunk = min(tokens, chunk_rows(vocab)) * vocab * acc.itemsize
    upcast = chunk if dtype != acc else 0
    return upcast if backward else chunk + upcast


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
    losses = logits.new_empty((tokens,), dtype=accumulate_dtype(logits.dtype))
    lse = torch.empty_like(losses)
    safe, kept = _row_terms(logits, targets, ignore_index)
    step = chunk_rows(vocab)
    for start in range(0, tokens, step):
        rows = slice(start, start + step)
        x = logits[rows].to(lse.dtype)                             # (n, V) float32
        chunk_lse = torch.logsumexp(x, dim=-1)                     # (n,)
        picked = x.gather(1, safe[rows, None]).squeeze(1)          # (n,)
        loss = chunk_lse - picked
        if label_smoothing:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (chunk_lse - x.mean(-1))
        lse[rows] = chunk_lse
        losses[rows] = torch.where(kept[rows], loss, torch.zeros_like(loss))
        del x                                 # freed before the next chunk is made
    return losses, lse


@_cross_entropy.register_fake
def _(logits, targets, ignore_index, label_smoothing):
    tokens, dtype = logits.shape[0], accumulate_dtype(logits.dtype)
    return logits.new_empty((tokens,), dtype=dtype), logits.new_empty((tokens,), dtype=dtype)


@torch.library.custom_op("torchalpa::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward(grad_losses: torch.Tensor, logits: torch.Tensor,
                            targets: torch.Tensor, lse: torch.Tensor, ignore_index: int,
                            label_smoothing: float) -> torch.Tensor:
    return backward_block(grad_losses, logits, targets, lse, ignore_index, label_smoothing,
                          0, logits.shape[1])


@_cross_entropy_backward.register_fake
def _(grad_losses, logits, targets, lse, ignore_index, label_smoothing):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _owned(targets: torch.Tensor, ignore_index: int, offset: int, size: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(targets as columns of the block ``[offset, offset + size)``, 0 where the block
    does not own them; whether it owns each; whether each row counts)."""
    local = targets - offset
    owned = (local >= 0) & (local < size) & (targets != ignore_index)
    return torch.where(owned, local, torch.zeros_like(local)), owned, targets != ignore_index


def backward_block(grad_losses: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
                   lse: torch.Tensor, ignore_index: int, label_smoothing: float, offset: int,
                   vocab: int) -> torch.Tensor:
    """The logits' gradient for the columns ``[offset, offset + V_local)`` of a vocabulary
    of ``vocab`` entries (the whole op: offset 0, ``vocab`` its width): local given the
    whole rows' ``lse``; the target's ``-(1 - eps)`` only where this block owns it."""
    tokens, size = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    in_place = logits.dtype == lse.dtype         # computed in the gradient's own rows
    safe, owned, kept = _owned(targets, ignore_index, offset, size)
    scale = torch.where(kept, grad_losses.to(lse.dtype), torch.zeros_like(lse))   # (N,)
    target_term = torch.where(owned, torch.full_like(lse, label_smoothing - 1.0),
                              torch.zeros_like(lse))                               # (N,)
    step = chunk_rows(size)
    for start in range(0, tokens, step):
        rows = slice(start, start + step)
        p = grad[rows].copy_(logits[rows]) if in_place else logits[rows].to(lse.dtype)
        p.sub_(lse[rows, None]).exp_()                             # (n, V) softmax
        if label_smoothing:
            p.sub_(label_smoothing / vocab)
        p.scatter_add_(1, safe[rows, None], target_term[rows, None])
        p.mul_(scale[rows, None])
        if not in_place:
            grad[rows] = p                                         # in the logits' dtype
        del p                                 # freed before the next chunk is made
    return grad


def _per_row(logits: torch.Tensor, fn) -> torch.Tensor:
    """``fn(rows of logits in the accumulating dtype, rows) -> (n,)`` over chunks of rows."""
    tokens, size = logits.shape
    out = logits.new_empty((tokens,), dtype=accumulate_dtype(logits.dtype))
    step = chunk_rows(size)
    for start in range(0, tokens, step):
        rows = slice(start, start + step)
        out[rows] = fn(logits[rows].to(out.dtype), rows)
    return out


def block_max(logits, targets, ignore_index, label_smoothing, offset, vocab) -> torch.Tensor:
    """Split form, statistic 1: each row's max over this block (all-reduced with max)."""
    return _per_row(logits, lambda x, rows: x.amax(-1))


def block_sum_exp(logits, targets, ignore_index, label_smoothing, offset, vocab, m
                  ) -> torch.Tensor:
    """Split form, statistic 2: each row's sum of ``exp(x - m)`` over this block, ``m``
    the whole row's max (all-reduced with sum)."""
    return _per_row(logits, lambda x, rows: torch.exp(x - m[rows, None]).sum(-1))


def block_linear(logits, targets, ignore_index, label_smoothing, offset, vocab, m, s
                 ) -> torch.Tensor:
    """Split form, statistic 3: each row's ``(1 - eps) x_t + eps sum(x) / V`` over this
    block (``x_t`` only where it owns the target; all-reduced with sum): the loss is
    ``lse`` minus it."""
    safe, owned, _ = _owned(targets, ignore_index, offset, logits.shape[1])
    eps = label_smoothing

    def term(x, rows):
        picked = x.gather(1, safe[rows, None]).squeeze(1)
        out = torch.where(owned[rows], picked, torch.zeros_like(picked)) * (1.0 - eps)
        return out + x.sum(-1) * (eps / vocab) if eps else out
    return _per_row(logits, term)


def block_finish(logits, targets, ignore_index, label_smoothing, offset, vocab, m, s, linear
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Split form, the results from the whole rows' statistics: ``(losses, lse)``, as the
    op's (every rank of the split holds them whole)."""
    lse = m + torch.log(s)
    losses = torch.where(targets != ignore_index, lse - linear, torch.zeros_like(lse))
    return losses, lse


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
        return loss.reshape(logits.shape[:-1]) if reduction == "none" else loss
    flat = logits.reshape(-1, logits.shape[-1])                      # (N, V)
    losses, _ = _cross_entropy(flat, targets.reshape(-1), int(ignore_index),
                               float(label_smoothing))               # (N,) float32
    if reduction == "none":
        return losses.reshape(targets.shape).to(logits.dtype)
    total = losses.sum()
    if reduction == "mean":
        total = total / (targets != ignore_index).sum()
    return total.to(logits.dtype)
