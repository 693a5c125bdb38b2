"""Softmax and log-softmax along one dim, and their backward.

Each output element depends on the max and the sum over the whole softmax dim. Softmax
keeps that dim whole (blocked); every other dim is independent rows and shards freely.
Log-softmax may also split it, as Megatron's vocab-parallel cross entropy does (the
logits of a vocabulary-split output layer then never have to be gathered): the dim is a
``synced`` factor whose per-row statistics are all-reduced between local phases
(``runtime/lowering/synced.py``): forward, the row max (all-reduce max) then the row sum of
``exp(x - max)`` (all-reduce sum); backward, ``grad - exp(y) * sum(grad)`` needs the row
sum of the incoming gradient (all-reduce sum). The backward ops
``grad * y - y * sum(grad * y)`` and ``grad - exp(y) * sum(grad)`` are linear in the
incoming gradient, so a Partial gradient passes through them.
"""

from __future__ import annotations

from torchalpa.passes.rules.common import arg
from torchalpa.passes.rules.registry import FactorNamer, normalize_dim, register

LOG_SOFTMAX_STATISTICS = ("max", "sum")      # row max, then row sum of exp(x - max)
LOG_SOFTMAX_BACKWARD_STATISTICS = ("sum",)   # row sum of the incoming gradient


def _rows(f: FactorNamer, shape, dim: int, blocked: bool = True):
    """Per dim its factor (none for size 1), and the softmax dim's factor (or None)."""
    dims: list[tuple[str, ...]] = []
    softmax_factor = None
    for d, s in enumerate(shape):
        if s == 1:
            dims.append(())
            continue
        factor = f.new(s, blocked=blocked and d == dim)
        dims.append((factor,))
        if d == dim:
            softmax_factor = factor
    return tuple(dims), softmax_factor


def _synced(factor, statistics) -> tuple:
    return () if factor is None else ((factor, statistics),)


@register("aten._softmax.default", "aten._safe_softmax.default")
def softmax(node, specs):
    shape = specs[0].shape
    f = FactorNamer()
    dims, _ = _rows(f, shape, normalize_dim(arg(node, 1, "dim"), max(len(shape), 1)))
    return f.rule([dims], [dims])


@register("aten._log_softmax.default")
def log_softmax(node, specs):
    shape = specs[0].shape
    f = FactorNamer()
    dims, factor = _rows(f, shape, normalize_dim(arg(node, 1, "dim"), max(len(shape), 1)),
                         blocked=False)
    return f.rule([dims], [dims], synced=_synced(factor, LOG_SOFTMAX_STATISTICS))


@register("aten._softmax_backward_data.default")
def softmax_backward(node, specs):
    shape = specs[0].shape
    f = FactorNamer()
    dims, _ = _rows(f, shape, normalize_dim(arg(node, 2, "dim"), max(len(shape), 1)))
    return f.rule([dims, dims], [dims], linear=(frozenset({0}),))


@register("aten._log_softmax_backward_data.default")
def log_softmax_backward(node, specs):
    shape = specs[0].shape
    f = FactorNamer()
    dims, factor = _rows(f, shape, normalize_dim(arg(node, 2, "dim"), max(len(shape), 1)),
                         blocked=False)
    return f.rule([dims, dims], [dims], linear=(frozenset({0}),),
                  synced=_synced(factor, LOG_SOFTMAX_BACKWARD_STATISTICS))
