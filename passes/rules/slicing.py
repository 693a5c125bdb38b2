"""Ops that cut, join or reorder a tensor along one dim: slice, select, split, unbind,
cat, stack, flip, pad, and the scatters that are the backward of slice and select.

The dim they work along is addressed by global positions (``start``/``end``, the split
sizes, which operand comes first), so it is blocked: a device's block of it would hold
other positions. Every other dim is shared by operands and results and shards freely.
A slice over a whole dim (``x[:, 0]`` traces as ``slice(dim 0, 0, end)`` then ``select``)
is no cut at all and keeps that dim shardable (its ``end`` clamps to the local size).
All of these are linear: a Partial passes through (pad only when it pads with zeros).
"""

from __future__ import annotations

from torchalpa.passes.rules.common import arg
from torchalpa.passes.rules.registry import FactorNamer, normalize_dim, register

_LINEAR = (frozenset({0}),)


def _along(f: FactorNamer, shape, dim: int, cut: bool):
    """Dims of ``shape`` with a fresh factor each; ``dim`` blocked when ``cut``."""
    return tuple((f.new(s, blocked=cut and d == dim),) if s != 1 else ()
                 for d, s in enumerate(shape))


def _with_dim(dims, dim: int, new):
    return dims[:dim] + (new,) + dims[dim + 1:]


def _full_slice(size: int, start, end, step) -> bool:
    """Whether ``[start:end:step]`` takes every position of a dim of ``size``."""
    start = 0 if start is None else start
    end = size if end is None else end
    return step in (None, 1) and start in (0, -size) and end >= size


@register("aten.slice.Tensor")
def slice_(node, specs):
    shape, out = specs[0].shape, node.outputs[0].shape
    dim = normalize_dim(arg(node, 1, "dim", 0), len(shape))
    f = FactorNamer()
    whole = _full_slice(shape[dim], arg(node, 2, "start"), arg(node, 3, "end"),
                        arg(node, 4, "step", 1))
    operand = _along(f, shape, dim, cut=not whole)
    result = operand if whole else _with_dim(operand, dim, (f.new(out[dim], blocked=True),)
                                             if out[dim] != 1 else ())
    return f.rule([operand], [result], linear=_LINEAR)


@register("aten.select.int")
def select(node, specs):
    shape = specs[0].shape
    dim = normalize_dim(arg(node, 1, "dim"), len(shape))
    f = FactorNamer()
    operand = _along(f, shape, dim, cut=True)
    return f.rule([operand], [operand[:dim] + operand[dim + 1:]], linear=_LINEAR)


def _pieces(f: FactorNamer, shape, dim: int, sizes) -> tuple | None:
    """For a dim cut into equal pieces (``k`` of size ``p``): the dims of ``shape`` with that
    dim read as ``(k, p)``: ``k`` blocked, ``p`` the position inside a piece, shared with the
    pieces; and ``p``'s dim entry. Splitting ``p`` gives every device its block of every
    piece: a strided shard of the whole dim (``placement.strided``), which is how a fused
    q/k/v projection splits by heads. None when the pieces differ in size."""
    if len(sizes) < 2 or len(set(sizes)) != 1 or sizes[0] < 2:
        return None
    dims = tuple((f.new(s),) if s != 1 and d != dim else () for d, s in enumerate(shape))
    count, piece = f.new(len(sizes), blocked=True), f.new(sizes[0])
    return _with_dim(dims, dim, (count, piece)), (piece,)


@register("aten.split.Tensor", "aten.split_with_sizes.default", "aten.unbind.int")
def split(node, specs):
    shape = specs[0].shape
    unbind = node.op == "aten.unbind.int"
    dim = normalize_dim(arg(node, 1 if unbind else 2, "dim", 0), len(shape))
    f = FactorNamer()
    if not unbind:
        pieces = _pieces(f, shape, dim, [spec.shape[dim] for spec in node.outputs])
        if pieces is not None:
            operand, piece = pieces
            results = [_with_dim(operand, dim, piece) for _ in node.outputs]
            return f.rule([operand], results, linear=_LINEAR, strided=frozenset(piece))
    operand = _along(f, shape, dim, cut=True)
    results = []
    for spec in node.outputs:
        if unbind:
            results.append(operand[:dim] + operand[dim + 1:])
        else:
            piece = spec.shape[dim]
            results.append(_with_dim(operand, dim, (f.new(piece, blocked=True),)
                                     if piece != 1 else ()))
    return f.rule([operand], results, linear=_LINEAR)


@register("aten.cat.default")
def cat(node, specs):
    out = node.outputs[0].shape
    dim = normalize_dim(arg(node, 1, "dim", 0), len(out))
    f = FactorNamer()
    if all(len(spec.shape) == len(out) for spec in specs):
        pieces = _pieces(f, out, dim, [spec.shape[dim] for spec in specs])
        if pieces is not None:   # equal pieces: the backward of a fused projection's split
            result, piece = pieces
            return f.rule([_with_dim(result, dim, piece)] * len(specs), [result],
                          linear=(frozenset(range(len(specs))),), strided=frozenset(piece))
    result = _along(f, out, dim, cut=True)
    operands = []
    for spec in specs:
        if len(spec.shape) != len(out):  # legacy: a 1-D empty tensor is skipped
            operands.append(tuple(() for _ in spec.shape))
            continue
        size = spec.shape[dim]
        operands.append(_with_dim(result, dim, (f.new(size, blocked=True),) if size != 1 else ()))
    return f.rule(operands, [result], linear=(frozenset(range(len(specs))),))


@register("aten.stack.default")
def stack(node, specs):
    out = node.outputs[0].shape
    dim = normalize_dim(arg(node, 1, "dim", 0), len(out))
    f = FactorNamer()
    result = _along(f, out, dim, cut=True)
    operand = result[:dim] + result[dim + 1:]
    return f.rule([operand] * len(specs), [result], linear=(frozenset(range(len(specs))),))


@register("aten.flip.default")
def flip(node, specs):
    shape = specs[0].shape
    flipped = {normalize_dim(d, len(shape)) for d in arg(node, 1, "dims")}
    f = FactorNamer()
    dims = tuple((f.new(s, blocked=d in flipped),) if s != 1 else () for d, s in enumerate(shape))
    return f.rule([dims], [dims], linear=_LINEAR)


@register("aten.constant_pad_nd.default")
def constant_pad_nd(node, specs):
    # pad lists (before, after) pairs from the last dim backwards.
    shape, out = specs[0].shape, node.outputs[0].shape
    pad = arg(node, 1, "pad")
    padded = {len(shape) - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    f = FactorNamer()
    operand, result = [], []
    for d, (s, o) in enumerate(zip(shape, out)):
        if d in padded:
            operand.append((f.new(s, blocked=True),) if s != 1 else ())
            result.append((f.new(o, blocked=True),) if o != 1 else ())
        else:
            fac = (f.new(s),) if s != 1 else ()
            operand.append(fac)
            result.append(fac)
    zero = arg(node, 2, "value", 0) in (0, 0.0)
    return f.rule([tuple(operand)], [tuple(result)], linear=_LINEAR if zero else ())


@register("aten.slice_scatter.default", "aten.select_scatter.default")
def slice_scatter(node, specs):
    # self (the output's shape) with ``src`` written into a slice / at an index of ``dim``.
    shape, src = specs[0].shape, specs[1].shape
    dim = normalize_dim(arg(node, 2, "dim", 0), len(shape))
    f = FactorNamer()
    if node.op == "aten.slice_scatter.default":
        whole = src[dim] == shape[dim] and _full_slice(
            shape[dim], arg(node, 3, "start"), arg(node, 4, "end"), arg(node, 5, "step", 1))
        out = _along(f, shape, dim, cut=not whole)
        source = out if whole else _with_dim(out, dim, (f.new(src[dim], blocked=True),)
                                             if src[dim] != 1 else ())
    else:
        out = _along(f, shape, dim, cut=True)
        source = out[:dim] + out[dim + 1:]
    return f.rule([out, source], [out], linear=(frozenset({0, 1}),))
