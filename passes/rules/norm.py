"""Normalization layers: layer norm and batch norm, forward and backward.

(RMS norm has no fused op in captured graphs: ``F.rms_norm`` traces as pow, mean, rsqrt
and mul, which have their own rules.)

Layer norm computes statistics over the trailing ``normalized_shape`` dims of each
row: those dims are blocked (a device would see part of a row), the leading (row) dims
shard freely. In the backward, the weight and bias gradients sum over the rows, so a
sharded row dim leaves them ``Partial``.

Batch norm in training mode computes statistics per channel over the batch and spatial
dims. The channel dim (1) shards freely. The batch and spatial dims shard as
*batch-synced* factors (synchronized batch norm, as XLA partitions Alpa's BatchNorm): the
devices that split them all-reduce their per-channel sums inside the op -- (sum x, sum x^2) in forward,
(sum dy, sum dy * x_hat) in backward, 2 values per local channel -- so every device
normalizes with the statistics of the whole batch, and the backward's weight and bias
gradients (those very sums) come out whole. The runtime runs the op that way
(``runtime/lowering/sync_norm.py``) for the ops it knows (``SYNCED_OPS``); other training variants
keep the batch whole. In eval mode (running statistics) every dim shards, and the
backward's weight / bias gradients are Partial over a sharded batch. Running statistics
updated in training are per channel, so they shard with the channel dim.

Group norm computes statistics per (sample, group) over the group's channels and the
spatial dims. The batch shards freely; the channel dim is read as (group, channel within
group), major first, so it shards by whole groups (the group factor), and the statistics
``(N, G)`` shard with it; the channels within a group and the spatial dims are blocked. In
the backward, the weight and bias gradients sum over the batch (``Partial`` when it is
split). The runtime passes each block its local ``N``, ``C`` and number of groups
(``runtime/lowering/localize.py``).
"""

from __future__ import annotations

from torchalpa.passes.rules.common import arg, by_position, positions
from torchalpa.passes.rules.registry import FactorNamer, register

__all__ = ["SYNCED_OPS", "layer_norm", "layer_norm_backward", "batch_norm",
           "batch_norm_backward", "group_norm", "group_norm_backward"]

_GRAD_LINEAR = (frozenset({0}),)

# training batch norm ops the runtime can run with a split batch (runtime/lowering/sync_norm.py)
SYNCED_OPS = frozenset({"aten._native_batch_norm_legit_functional.default",
                        "aten._native_batch_norm_legit.no_stats",
                        "aten.native_batch_norm_backward.default"})


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


def _batch_norm_dims(f: FactorNamer, shape, blocked: bool):
    """(input dims, channel dims): batch and spatial dims blocked when ``blocked``."""
    x = tuple((f.new(s, blocked=blocked and d != 1),) if s != 1 else ()
              for d, s in enumerate(shape))
    return x, (x[1] if len(shape) > 1 else (),)


def _sync(node, specs, x, channel, training: bool) -> dict:
    """The rule's ``batch_synced`` fields: the batch and spatial factors of a training op the
    runtime can synchronize, 2 statistics per channel in the dtype it accumulates in."""
    if not training or node.op not in SYNCED_OPS:
        return {}
    itemsize = 8 if specs[0].dtype == "float64" else 4    # half types accumulate in fp32
    others = frozenset(fac for d, dims in enumerate(x) if d != 1 for fac in dims)
    return {"batch_synced": others, "batch_sync_stats": (2 * itemsize, channel[0])}


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
    syncable = training and node.op in SYNCED_OPS
    x, channel = _batch_norm_dims(f, node.outputs[0].shape, training and not syncable)
    operands = _batch_norm_operands(node, specs, x, channel, 1)
    results = [x]
    independent = [frozenset()]
    for spec in node.outputs[1:num_results]:
        per_channel = len(spec.shape) == 1 and len(x) > 1 and spec.shape[0] == \
            node.outputs[0].shape[1]
        results.append(channel if per_channel else tuple(() for _ in spec.shape))
        # eval-mode statistics outputs are empty: they depend on nothing
        independent.append(frozenset() if per_channel else f.all())
    return f.rule(operands, results, independent=tuple(independent),
                  **_sync(node, specs, x, channel, training))


@register("aten.native_batch_norm_backward.default")
def batch_norm_backward(node, specs):
    # (grad_out, input, weight?, running_mean?, running_var?, save_mean?, save_invstd?,
    #  train, eps, output_mask) -> (grad_input, grad_weight, grad_bias)
    training = bool(arg(node, 7, "train"))
    f = FactorNamer()
    syncable = training and node.op in SYNCED_OPS
    x, channel = _batch_norm_dims(f, specs[0].shape, training and not syncable)
    operands = _batch_norm_operands(node, specs, x, channel, 2)
    others = [fac for d, dims in enumerate(x) if d != 1 for fac in dims]
    reductions = () if training else tuple((fac, "sum") for fac in others)
    mask = arg(node, 9, "output_mask", (True, True, True))
    return f.rule(operands, [x, channel, channel], reductions=reductions, linear=_GRAD_LINEAR,
                  independent=_absent(f, mask), **_sync(node, specs, x, channel, training))


def _group_norm_dims(f: FactorNamer, shape, num_groups: int):
    """(input dims, channel dims, statistics dims) of a group norm over ``shape``
    (N, C, *spatial): the channel dim is (group, channel within group), the second blocked."""
    batch = f.dims(shape[:1])
    group = (f.new(num_groups),) if num_groups != 1 else ()
    within = shape[1] // num_groups
    channel = (group + ((f.new(within, blocked=True),) if within != 1 else ()),)
    x = batch + channel + f.dims(shape[2:], blocked=True)
    return x, channel, batch + (group,)


@register("aten.native_group_norm.default")
def group_norm(node, specs):
    # (input, weight?, bias?, N, C, HxW, group, eps) -> (out, mean (N, G), rstd (N, G))
    f = FactorNamer()
    x, channel, stats = _group_norm_dims(f, specs[0].shape, int(arg(node, 6, "group")))
    operands = by_position(node, lambda key: x if key == 0 else channel)  # weight, bias
    return f.rule(operands, [x, stats, stats])


@register("aten.native_group_norm_backward.default")
def group_norm_backward(node, specs):
    # (grad_out, input, mean, rstd, weight?, N, C, HxW, group, output_mask)
    #   -> (grad_input, grad_weight, grad_bias)
    f = FactorNamer()
    x, channel, stats = _group_norm_dims(f, specs[0].shape, int(arg(node, 8, "group")))
    dims = {0: x, 1: x, 2: stats, 3: stats, 4: channel}
    operands = by_position(node, dims.__getitem__)
    # the weight and bias gradients sum over the batch and the (blocked) spatial dims
    reductions = tuple((fac, "sum") for fac in x[0])
    mask = arg(node, 9, "output_mask", (True, True, True))
    return f.rule(operands, [x, channel, channel], reductions=reductions,
                  linear=_GRAD_LINEAR, independent=_absent(f, mask))
