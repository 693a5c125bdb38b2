"""Rewrite one ATen call of the global program for the local blocks of this rank.

Most ops work on blocks unchanged. Ops that carry a shape (view, expand, factories)
get the local shape of their result instead, ``*_like`` factories become ``full`` of the
local shape (their operand is read for shape only and is not resharded), and device
arguments point at this rank's device (the graph may have been captured on ``meta``).
"""

from __future__ import annotations

import torch

from torchalpa.placement import local_shape
from torchalpa.plan import NodeStrategy

__all__ = ["localize"]

aten = torch.ops.aten

# op -> index of its shape argument
_SHAPE_ARG = {
    "aten.view.default": 1, "aten._unsafe_view.default": 1, "aten.reshape.default": 1,
    "aten.expand.default": 1, "aten.full.default": 0, "aten.zeros.default": 0,
    "aten.ones.default": 0, "aten.empty.memory_format": 0,
}
# *_like op -> how to read the fill value from its args
_LIKE = {
    "aten.full_like.default": lambda args: args[1],
    "aten.zeros_like.default": lambda args: 0,
    "aten.ones_like.default": lambda args: 1,
    "aten.empty_like.default": lambda args: 0,
}


def localize(node, args: list, kwargs: dict, strategy: NodeStrategy, mesh_shape,
             device: torch.device):
    """(target, args, kwargs) of the local call for fx ``node`` under ``strategy``."""
    op = str(node.target)
    target = node.target
    if "device" in kwargs:
        kwargs = dict(kwargs, device=device)
    if op in _SHAPE_ARG or op in _LIKE:
        val = node.meta["val"]
        shape = list(local_shape(tuple(val.shape), strategy.outputs[0], mesh_shape))
        if op in _SHAPE_ARG:
            args = list(args)
            args[_SHAPE_ARG[op]] = shape
        else:
            target = aten.full.default
            args = [shape, _LIKE[op](args)]
            kwargs = {"dtype": val.dtype, "device": device}
    return target, args, kwargs
