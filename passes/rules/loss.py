"""Losses: negative log-likelihood (what cross-entropy becomes after log_softmax), and the
fused cross-entropy op (``torchalpa/ops/cross_entropy.py``).

``nll_loss_forward(self (N, C), target (N), weight (C)?, reduction, ignore_index)
-> (output, total_weight)``. The class dim ``C`` is blocked: targets are global class
numbers. The batch dim ``N`` shards freely with ``reduction='none'``; with ``'sum'``
both outputs are Partial sums; with ``'mean'`` (sum of losses / sum of weights, counting
only targets that are not ``ignore_index``) a device's own mean is not a piece of the
global one, so ``N`` is blocked.

``nll_loss_backward(grad, self, target, weight?, reduction, ignore_index, total_weight)``
writes ``-weight[t] * grad / total_weight`` into each row's target column: rows are
independent given the global ``total_weight``, so ``N`` shards for every reduction, and
the op is linear in ``grad``.

``torchalpa::cross_entropy(logits (N, V), targets (N), ignore_index, label_smoothing)
-> (losses (N), lse (N))`` and its backward ``(grad (N), logits, targets, lse, ...) ->
grad_logits (N, V)``: tokens are independent, so ``N`` shards freely (the mean over
tokens is taken by ordinary ops after it). The vocabulary ``V`` splits too, as
Megatron's vocab-parallel cross-entropy splits it, so that a head whose logits are split
by vocabulary never gathers them: forward ``V`` is a ``synced`` factor whose per-token
statistics are all-reduced between local phases (``runtime/lowering/synced.py``): the
row max (max), the row sum of ``exp(x - max)`` (sum) and the target's logit where the
block owns it, with the smoothing's row sum (sum); the results (N,) are then whole on
every device of the split. Backward is local given the whole rows' ``lse``: each block
writes its own columns (``runtime/lowering/localize.py``). The backward is linear in
``grad``.
"""

from __future__ import annotations

from torchalpa.passes.rules.common import arg, positions
from torchalpa.passes.rules.registry import FactorNamer, register

_NONE, _MEAN, _SUM = 0, 1, 2


def _dims(f: FactorNamer, shape, block_batch: bool):
    """(self dims, target dims, class dims) for self of shape (N, C) or (C,)."""
    c = (f.new(shape[-1], blocked=True),) if shape[-1] != 1 else ()
    if len(shape) == 1:
        return (c,), (), (c,)
    n = (f.new(shape[0], blocked=block_batch),) if shape[0] != 1 else ()
    return (n, c), (n,), (c,)


@register("aten.nll_loss_forward.default")
def nll_loss_forward(node, specs):
    reduction = arg(node, 3, "reduction", _MEAN)
    f = FactorNamer()
    x, target, classes = _dims(f, specs[0].shape, block_batch=reduction == _MEAN)
    table = {0: x, 1: target, 2: classes}
    operands = [table[key] for key in positions(node)]
    if reduction == _NONE:
        return f.rule(operands, [target, ()], independent=(frozenset(), f.all()))
    reductions = tuple((fac, "sum") for fac in target[0]) if target else ()
    return f.rule(operands, [(), ()], reductions=reductions)


@register("aten.nll_loss_backward.default")
def nll_loss_backward(node, specs):
    reduction = arg(node, 4, "reduction", _MEAN)
    f = FactorNamer()
    x, target, classes = _dims(f, specs[1].shape, block_batch=False)
    grad = target if reduction == _NONE else tuple(() for _ in specs[0].shape)
    table = {0: grad, 1: x, 2: target, 3: classes, 6: ()}
    operands = [table[key] for key in positions(node)]
    return f.rule(operands, [x], linear=(frozenset({0}),))


FUSED_CROSS_ENTROPY_STATISTICS = ("max", "sum", "sum")
"""Per token: the row max, the row sum of exponentials, the target's (and smoothing's) term."""


def _token_dims(f: FactorNamer, shape):
    """(logits dims, per-token dims, the vocabulary's factor or None) of logits (N, V)."""
    n = (f.new(shape[0]),) if shape[0] != 1 else ()
    v = (f.new(shape[1]),) if shape[1] != 1 else ()
    return (n, v), (n,), (v[0] if v else None)


@register("torchalpa.cross_entropy.default")
def fused_cross_entropy(node, specs):
    # (logits, targets, ignore_index, label_smoothing) -> (losses, lse)
    f = FactorNamer()
    logits, token, vocab = _token_dims(f, specs[0].shape)
    synced = () if vocab is None else ((vocab, FUSED_CROSS_ENTROPY_STATISTICS),)
    return f.rule([logits, token], [token, token], synced=synced)


@register("torchalpa.cross_entropy_backward.default")
def fused_cross_entropy_backward(node, specs):
    # (grad_losses, logits, targets, lse, ignore_index, label_smoothing) -> grad_logits
    f = FactorNamer()
    logits, token, _ = _token_dims(f, specs[1].shape)
    return f.rule([token, logits, token, token], [logits], linear=(frozenset({0}),))
