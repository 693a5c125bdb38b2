"""Normalization layers: layer norm and batch norm, forward and backward.

(RMS norm has no fused op in captured graphs: ``F.rms_norm`` traces as pow, mean, rsqrt
and mul, which have their own rules.)

Layer norm computes statistics over the trailing ``normalized_shape`` dims of each
row: those dims are blocked (a device would see part of a row), the leading (row) dims
shard freely. In the backward, the weight and bias gradients sum over the rows, so a
sharded row dim leaves them ``Partial``.

Batch norm in training mode computes statistics per channel over the batch and spatial
dims: only the channel dim (1) shards; batch and spatial dims are blocked (splitting the
batch would give each device its own statistics, i.e. a different model). In eval mode
(running statistics) every dim shards, and the backward's weight / bias gradients are
Partial over a sharded batch. Running statistics updated in training are per channel,
so they shard with the channel dim.
"""

from __future__ import annotations

from torchalpa.passes.rules.registry import FactorNamer, register
from torchalpa.passes.rules.common import arg, by_position, positions

_GRAD_LINEAR = (frozenset({0}),)


def _row_dims(f: FactorNamer, shape, num_normalized: int):
    """(row dims, normalized dims): fresh factors, the normalized ones blocked."""
    axis = len(shape) - num_normalized
    return f.dims(shape[:axis]), f.dims(shape[axis:], blocked=True)


def _stats(rows, num_normalized: int):
    return rows + ((),) * num_normalized


def _absent(f: FactorNamer, mask) -> tuple:
    """``independent`` entries: results the output mask leaves out depend on nothing."""
    return tuple(frozenset() if keep else f.all() for keep in mask)


@register("aten.native_layer_norm.default")
def layer_norm(node, specs):
    shape = node.outputs[0].shape
    num = len(arg(node, 1, "normalized_shape"))
    f = FactorNamer()
    rows, norm = _row_dims(f, shape, num)
    x = rows + norm
    operands = by_position(node, lambda key: x if key == 0 else norm)  # weight, bias
    return f.rule(operands, [x, _stats(rows, num), _stats(rows, num)])


@register("aten.native_layer_norm_backward.default")
def layer_norm_backward(node, specs):
    # (grad_out, input, normalized_shape, mean, rstd, weight?, bias?, output_mask)
    shape = specs[0].shape
    num = len(arg(node, 2, "normalized_shape"))
    f = FactorNamer()
    rows, norm = _row_dims(f, shape, num)
    x = rows + norm
    dims = {0: x, 1: x, 3: _stats(rows, num), 4: _stats(rows, num), 5: norm, 6: norm}
    operands = by_position(node, dims.__getitem__)
    reductions = tuple((fac, "sum") for d in rows for fac in d)
    mask = arg(node, 7, "output_mask", (True, True, True))
    return f.rule(operands, [x, norm, norm], reductions=reductions, linear=_GRAD_LINEAR,
                  independent=_absent(f, mask))


def _batch_norm_dims(f: FactorNamer, shape, training: bool):
    """(input dims, channel dims): batch and spatial dims blocked when ``training``."""
    x = tuple((f.new(s, blocked=training and d != 1),) if s != 1 else ()
              for d, s in enumerate(shape))
    return x, (x[1] if len(shape) > 1 else (),)


def _batch_norm_operands(node, specs, x, channel, num_like_input: int):
    """The first ``num_like_input`` operands are shaped like the input, the rest are per
    channel (C,) -- or empty placeholders in eval mode, which index no factor."""
    channels = specs[0].shape[1] if len(x) > 1 else None
    operands = []
    for key, spec in zip(positions(node), specs):
        if isinstance(key, int) and key < num_like_input:
            operands.append(x)
        elif spec.shape == (channels,):
            operands.append(channel)
        else:
            operands.append(tuple(() for _ in spec.shape))
    return operands


# op -> (index of ``training`` or None for eval-only, number of results)
_BATCH_NORM = {
    "aten.native_batch_norm.default": (5, 3),
    "aten._native_batch_norm_legit.default": (5, 3),
    "aten._native_batch_norm_legit.no_stats": (3, 3),
    "aten._native_batch_norm_legit_functional.default": (5, 5),
    "aten._native_batch_norm_legit_no_training.default": (None, 3),
}


@register(*_BATCH_NORM)
def batch_norm(node, specs):
    # (input, weight?, bias?, [running_mean, running_var,] training, momentum, eps)
    train_index, num_results = _BATCH_NORM[node.op]
    training = bool(arg(node, train_index, "training")) if train_index is not None else False
    f = FactorNamer()
    x, channel = _batch_norm_dims(f, node.outputs[0].shape, training)
    operands = _batch_norm_operands(node, specs, x, channel, 1)
    results = [x]
    independent = [frozenset()]
    for spec in node.outputs[1:num_results]:
        per_channel = len(spec.shape) == 1 and len(x) > 1 and spec.shape[0] == \
            node.outputs[0].shape[1]
        results.append(channel if per_channel else tuple(() for _ in spec.shape))
        # eval-mode statistics outputs are empty: they depend on nothing
        independent.append(frozenset() if per_channel else f.all())
    return f.rule(operands, results, independent=tuple(independent))


@register("aten.native_batch_norm_backward.default")
def batch_norm_backward(node, specs):
    # (grad_out, input, weight?, running_mean?, running_var?, save_mean?, save_invstd?,
    #  train, eps, output_mask) -> (grad_input, grad_weight, grad_bias)
    training = bool(arg(node, 7, "train"))
    f = FactorNamer()
    x, channel = _batch_norm_dims(f, specs[0].shape, training)
    operands = _batch_norm_operands(node, specs, x, channel, 2)
    others = [fac for d, dims in enumerate(x) if d != 1 for fac in dims]
    reductions = () if training else tuple((fac, "sum") for fac in others)
    mask = arg(node, 9, "output_mask", (True, True, True))
    return f.rule(operands, [x, channel, channel], reductions=reductions, linear=_GRAD_LINEAR,
                  independent=_absent(f, mask))
