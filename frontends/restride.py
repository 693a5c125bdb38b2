"""Strided views that are plain reshapes, written as reshapes.

Decompositions of layout-sensitive ops record ``as_strided`` with explicit strides: the
backward of ``adaptive_avg_pool2d`` on a channels-last map (ConvNeXt's and Swin's
``avgpool``) builds its gradient by ``as_strided_scatter`` into a flat buffer of zeros, and
``Tensor.clone`` of a view becomes ``new_empty_strided`` + ``copy``. Read literally, these
ops address memory: no sharding rule can split them (they run replicated, every device
gathering the whole tensor), and their result depends on the memory layout of their input,
which a lowered program need not reproduce. Where the strides are exactly those of a
contiguous tensor of the op's shape (dims of size 1 aside, whose stride never matters)
and the input is contiguous from its first element, each op is a reshape:

- ``as_strided(x, size, stride)`` -> ``reshape(x, size)``;
- ``as_strided_scatter(base, src, size, stride)`` covering all of ``base`` ->
  ``reshape(src, base.shape)`` (every element of ``base`` is overwritten);
- ``new_empty_strided(x, size, stride)`` -> ``new_empty(x, size)`` (values unwritten).

Anything else is left as it is (and listed as an op without a rule).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.fx as fx

__all__ = ["reshape_plain_restrides"]

aten = torch.ops.aten


def _contiguous_strides(size: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for s in reversed(size):
        strides.append(step)
        step *= max(int(s), 1)
    return strides[::-1]


def _plain(size, stride) -> bool:
    """``stride`` lays ``size`` out contiguously (size-1 dims may have any stride)."""
    if len(size) != len(stride):
        return False
    want = _contiguous_strides(size)
    return all(int(n) == 1 or int(s) == w for n, s, w in zip(size, stride, want))


def _whole_from_start(node) -> bool:
    """The traced value of ``node`` is contiguous and starts its storage."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return (isinstance(val, torch.Tensor) and val.is_contiguous()
            and val.storage_offset() == 0)


def _offset(n: fx.Node, position: int):
    if len(n.args) > position:
        return n.args[position]
    return n.kwargs.get("storage_offset")


def reshape_plain_restrides(gm: fx.GraphModule) -> int:
    """Rewrite the plain-reshape forms above in place; returns how many were rewritten."""
    rewritten = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        replacement = None
        if n.target is aten.as_strided.default:
            x, size, stride = n.args[:3]
            if (_plain(size, stride) and _offset(n, 3) in (None, 0) and _whole_from_start(x)
                    and math.prod(size) == x.meta["val"].numel()):
                with gm.graph.inserting_before(n):
                    replacement = gm.graph.call_function(aten.reshape.default, (x, list(size)))
        elif n.target is aten.as_strided_scatter.default:
            base, src, size, stride = n.args[:4]
            if (_plain(size, stride) and _offset(n, 4) in (None, 0) and _whole_from_start(base)
                    and math.prod(size) == base.meta["val"].numel()
                    and isinstance(src, fx.Node)
                    and list(src.meta["val"].shape) == list(size)
                    and src.meta["val"].dtype == base.meta["val"].dtype):
                with gm.graph.inserting_before(n):
                    replacement = gm.graph.call_function(
                        aten.reshape.default, (src, list(base.meta["val"].shape)))
        elif n.target is aten.new_empty_strided.default:
            x, size, stride = n.args[:3]
            if _plain(size, stride):
                with gm.graph.inserting_before(n):
                    replacement = gm.graph.call_function(aten.new_empty.default,
                                                         (x, list(size)), dict(n.kwargs))
        if replacement is not None:
            replacement.meta = dict(n.meta)
            n.replace_all_uses_with(replacement)
            gm.graph.erase_node(n)
            rewritten += 1
    if rewritten:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return rewritten
