"""A dim viewed as (pieces, size) and cut into its pieces, written as a split of the dim.

timm's and many fused attentions write ``q, k, v = qkv(x).view(B, S, 3, H).unbind(2)``.
ATen traces it as a view of the fused dim as ``(3, H)``, then a size-1 ``slice`` of the
pieces dim and a ``squeeze`` per piece; its backward ``stack``s the pieces' gradients on
that dim and views them back as ``3H``. Read literally, the ``H`` of each piece is a minor
factor of the fused dim, which a device could hold only as a strided shard that the view's
rule does not offer (it offers one for a view as ``(pieces, heads, head dim)`` only,
``passes/rules/view.py``): the projection could not be split by heads. The same cut written
``qkv(x).split(H, dim=-1)`` (nanoGPT's) is split by heads (``passes/rules/slicing.py``:
equal pieces of a dim read as (count, piece), the piece a strided shard). This rewrite
makes the first spelling the second, exactly:

- ``slice(view(y, (.., k, n, ..)), d, i, i + 1)`` -> ``unsqueeze(split(y, n, d)[i], d)``, when
  the view only splits ``y``'s dim ``d`` (of size ``k * n``, ``2 <= k <= 8``) into ``(k, n)``
  and every user of the view is such a slice;
- ``view(stack(xs, d), merge d, d + 1)`` -> ``cat(xs, d)`` (the backward of the above).

Indexing, ``y = qkv(x).view(B, S, 3, H); q, k, v = y[:, :, 0], y[:, :, 1], y[:, :, 2]``,
traces as a ``select`` per piece, and its backward as one ``where(arange(k) == i, g_i, 0)``
per piece over the whole ``(B, S, 3, H)`` view, summed: a sum of masked broadcasts that no
rule reads as a concatenation. It is written the same way:

- ``select(view(y, (.., k, n, ..)), d, i)`` -> ``split(y, n, d)[i]`` (with the slices above:
  every user of the view a slice or a select of one piece);
- ``view(where(eq(arange(k) viewed on d, i_0), expand(unsqueeze(g_0, d)), 0) + ..., merge
  d, d + 1)`` -> ``cat([g_0, ..., g_{k-1}], d)``, when the sum holds each of the ``k``
  pieces once (the backward of the selects).

Anything else is left as it is.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

__all__ = ["split_piece_views"]

aten = torch.ops.aten

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_MAX_PIECES = 8   # a fused q/k/v has 3, a fused gate/up 2; more pieces are no projection


def _shape(n) -> tuple[int, ...] | None:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _split_dim(before: tuple, after: tuple) -> int | None:
    """The dim ``d`` of ``before`` that ``after`` reads as two dims (``d``, ``d + 1``) of
    2 to 8 pieces each, all else equal; None otherwise."""
    if len(after) != len(before) + 1:
        return None
    for d in range(len(before)):
        if before[:d] == after[:d] and before[d + 1:] == after[d + 2:]:
            k, n = after[d], after[d + 1]
            if 2 <= k <= _MAX_PIECES and k * n == before[d] and n > 1:
                return d
            return None
    return None


def _piece_index(user: fx.Node, view: fx.Node, d: int) -> int | None:
    """``i`` when ``user`` is ``slice(view, d, i, i + 1)`` or ``select(view, d, i)``."""
    shape = _shape(view) or ()
    rank = len(shape)
    if user.target is aten.select.int and user.args[0] is view and len(user.args) == 3:
        dim, index = user.args[1], user.args[2]
        if isinstance(dim, int) and isinstance(index, int) and rank and dim % rank == d:
            return index % shape[d]
        return None
    if user.target is not aten.slice.Tensor or user.args[0] is not view:
        return None
    args = list(user.args) + [None] * (5 - len(user.args))
    dim, start, end, step = args[1], args[2], args[3], args[4]
    if not (isinstance(dim, int) and isinstance(start, int)) or dim % rank != d or \
            step not in (None, 1):
        return None
    return start if end == start + 1 else None


def _with_meta(node: fx.Node, like: fx.Node, val) -> fx.Node:
    node.meta = dict(like.meta)
    node.meta["val"] = val
    return node


def _split_slices(gm: fx.GraphModule, view: fx.Node) -> int:
    y = view.args[0]
    before, after = _shape(y), _shape(view)
    if not isinstance(y, fx.Node) or before is None or after is None:
        return 0
    d = _split_dim(before, after)
    if d is None:
        return 0
    users = list(view.users)
    pieces = [_piece_index(u, view, d) for u in users]
    if not users or any(i is None for i in pieces):
        return 0
    g, n = gm.graph, after[d + 1]
    with g.inserting_after(y):
        split = _with_meta(g.call_function(aten.split.Tensor, (y, n, d)), view,
                           list(aten.split.Tensor(y.meta["val"], n, d)))
    for user, i in zip(users, pieces):
        assert i is not None
        with g.inserting_before(user):
            piece = _with_meta(g.call_function(operator.getitem, (split, i)), user,
                               split.meta["val"][i])
            lifted = piece if user.target is aten.select.int else _with_meta(
                g.call_function(aten.unsqueeze.default, (piece, d)), user, user.meta["val"])
        user.replace_all_uses_with(lifted)
        g.erase_node(user)
    return len(users)


def _cat_of_stack(gm: fx.GraphModule, view: fx.Node) -> int:
    stack = view.args[0]
    if not isinstance(stack, fx.Node) or stack.target is not aten.stack.default:
        return 0
    pieces = stack.args[0]
    merged, stacked = _shape(view), _shape(stack)
    dim = stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)
    if merged is None or stacked is None or not isinstance(dim, int) or \
            not isinstance(pieces, (list, tuple)):
        return 0
    d = dim % len(stacked)
    if d + 1 >= len(stacked) or _split_dim(merged, stacked) != d:
        return 0
    with gm.graph.inserting_before(view):
        cat = _with_meta(gm.graph.call_function(aten.cat.default, (list(pieces), d)), view,
                         view.meta["val"])
    view.replace_all_uses_with(cat)
    gm.graph.erase_node(view)
    return 1


def _summands(node: fx.Node) -> list[fx.Node]:
    """The terms of a chain of plain ``add``s (each read by the next alone)."""
    if node.target is not aten.add.Tensor or node.kwargs.get("alpha", 1) != 1 or \
            len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
        return [node]
    out: list[fx.Node] = []
    for term in node.args:
        assert isinstance(term, fx.Node)
        out += _summands(term) if len(term.users) == 1 else [term]
    return out


def _is_zeros(node) -> bool:
    return isinstance(node, fx.Node) and bool(
        (node.target is aten.full.default and node.args[1] == 0)
        or node.target in (aten.zeros.default, aten.zeros_like.default))


def _masked_piece(node: fx.Node, d: int, k: int) -> tuple[int, fx.Node] | None:
    """``(i, g)`` when ``node`` is ``where(arange(k) viewed on dim d == i,
    expand(unsqueeze(g, d)), 0)``: the gradient of ``select(.., d, i)`` put in place."""
    if node.target is not aten.where.self or len(node.args) != 3:
        return None
    cond, spread, zero = node.args
    if not (isinstance(cond, fx.Node) and cond.target is aten.eq.Scalar and _is_zeros(zero)
            and isinstance(spread, fx.Node) and spread.target is aten.expand.default):
        return None
    index, i = cond.args
    rank = len(_shape(node) or ())
    if not (isinstance(index, fx.Node) and index.target in _VIEWS and isinstance(i, int)
            and _shape(index) == tuple(k if j == d else 1 for j in range(rank))):
        return None
    arange = index.args[0]
    if not (isinstance(arange, fx.Node) and arange.target is aten.arange.start_step
            and tuple(arange.args[:2]) == (0, k) and arange.args[2:] in ((), (1,))):
        return None
    lifted = spread.args[0]
    if not (isinstance(lifted, fx.Node) and lifted.target is aten.unsqueeze.default
            and isinstance(lifted.args[1], int) and lifted.args[1] % rank == d
            and isinstance(lifted.args[0], fx.Node)):
        return None
    return i, lifted.args[0]


def _cat_of_masked_sum(gm: fx.GraphModule, view: fx.Node) -> int:
    total, merged = view.args[0], _shape(view)
    stacked = _shape(total)
    if not isinstance(total, fx.Node) or merged is None or stacked is None:
        return 0
    d = _split_dim(merged, stacked)
    if d is None:
        return 0
    k = stacked[d]
    pieces = [p for t in _summands(total) if (p := _masked_piece(t, d, k)) is not None]
    if len(pieces) != len(_summands(total)) or sorted(i for i, _ in pieces) != list(range(k)):
        return 0
    grads = [g for _, g in sorted(pieces, key=lambda p: p[0])]
    with gm.graph.inserting_before(view):
        cat = _with_meta(gm.graph.call_function(aten.cat.default, (grads, d)), view,
                         view.meta["val"])
    view.replace_all_uses_with(cat)
    gm.graph.erase_node(view)
    return 1


def split_piece_views(gm: fx.GraphModule) -> int:
    """Rewrite the forms above in place; returns how many ops were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _VIEWS:
            rewritten += (_split_slices(gm, node) or _cat_of_stack(gm, node)
                          or _cat_of_masked_sum(gm, node))
    if rewritten:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return rewritten
