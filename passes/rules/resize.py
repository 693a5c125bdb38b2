"""Resizing the trailing spatial dims: upsampling (nearest, linear, bilinear, bicubic,
trilinear, anti-aliased), forward and backward, and ``Tensor.unfold`` (sliding windows).

An upsampling op resizes the last 1, 2 or 3 dims; every output pixel reads input pixels
near the same relative position, so the leading dims (batch, channels) shard freely and
the spatial dims are blocked (a block of the output would need input pixels across the
block edge, and the interpolation weights depend on the whole size). The backward is
linear in the incoming gradient; its ``input_size`` argument spells out the whole input
shape, which the runtime rewrites to the block's (``runtime/lowering/localize.py``).

``unfold(dim, size, step)`` cuts ``dim`` into windows and appends a window dim: every
other dim shards freely, the cut dim and the window dim are blocked.
"""

from __future__ import annotations

from torchalpa.core.resize_ops import UPSAMPLE_BACKWARDS, UPSAMPLES
from torchalpa.passes.rules.common import arg
from torchalpa.passes.rules.registry import FactorNamer, normalize_dim, register

__all__ = ["UPSAMPLES", "UPSAMPLE_BACKWARDS", "upsample", "upsample_backward", "unfold"]

def _resized(f: FactorNamer, lead, shape, spatial: int):
    return lead + f.dims(shape[len(shape) - spatial:], blocked=True)


@register(*UPSAMPLES)
def upsample(node, specs):
    # (input, output_size, [align_corners,] scales...) -> output
    spatial = UPSAMPLES[node.op]
    shape = specs[0].shape
    f = FactorNamer()
    lead = f.dims(shape[:len(shape) - spatial])
    x = _resized(f, lead, shape, spatial)
    y = _resized(f, lead, node.outputs[0].shape, spatial)
    return f.rule([x], [y], linear=(frozenset({0}),))


@register(*UPSAMPLE_BACKWARDS)
def upsample_backward(node, specs):
    # (grad_output, output_size, input_size, [align_corners,] scales...) -> grad_input
    spatial = UPSAMPLE_BACKWARDS[node.op]
    shape = node.outputs[0].shape
    f = FactorNamer()
    lead = f.dims(shape[:len(shape) - spatial])
    grad_in = _resized(f, lead, shape, spatial)
    grad_out = _resized(f, lead, specs[0].shape, spatial)
    return f.rule([grad_out], [grad_in], linear=(frozenset({0}),))


@register("aten.unfold.default")
def unfold(node, specs):
    # (input, dim, size, step) -> input with ``dim`` cut into windows, the window dim last
    shape = specs[0].shape
    if not shape:
        return None                     # a 0-d input: nothing to split
    dim = normalize_dim(int(arg(node, 1, "dimension")), len(shape))
    f = FactorNamer()
    x = tuple(f.dims([s], blocked=d == dim)[0] for d, s in enumerate(shape))
    out_shape = node.outputs[0].shape
    windows = f.dims(out_shape[dim:dim + 1], blocked=True)          # (num_windows,)
    y = x[:dim] + windows + x[dim + 1:] + f.dims(out_shape[-1:], blocked=True)
    return f.rule([x], [y], linear=(frozenset({0}),))
