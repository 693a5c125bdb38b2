"""Softmax and log-softmax along one dim, and their backward.

Each output element depends on the max and the sum over the whole softmax dim, so that
dim is blocked; every other dim is independent rows and shards freely. The backward ops
``grad * y - y * sum(grad * y)`` and ``grad - exp(y) * sum(grad)`` are linear in the
incoming gradient, so a Partial gradient passes through them.
"""

from __future__ import annotations

from torchalpa.passes.rules.registry import FactorNamer, normalize_dim, register
from torchalpa.passes.rules.common import arg


def _rows(f: FactorNamer, shape, dim: int):
    return tuple((f.new(s, blocked=d == dim),) if s != 1 else () for d, s in enumerate(shape))


@register("aten._softmax.default", "aten._log_softmax.default", "aten._safe_softmax.default")
def softmax(node, specs):
    shape = specs[0].shape
    f = FactorNamer()
    dims = _rows(f, shape, normalize_dim(arg(node, 1, "dim"), max(len(shape), 1)))
    return f.rule([dims], [dims])


@register("aten._softmax_backward_data.default", "aten._log_softmax_backward_data.default")
def softmax_backward(node, specs):
    shape = specs[0].shape
    f = FactorNamer()
    dims = _rows(f, shape, normalize_dim(arg(node, 2, "dim"), max(len(shape), 1)))
    return f.rule([dims, dims], [dims], linear=(frozenset({0}),))
