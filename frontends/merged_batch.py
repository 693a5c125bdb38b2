"""A batch matmul over batch dims the model merged itself, written as one over them all.

Attention written with ``torch.bmm`` reshapes ``(B, heads, S, hd)`` to ``(B * heads, S,
hd)`` first and views the result back. Read literally, the merged dim splits only by its
leading factor (the batch), so such attention could not be split by heads: every
head-parallel plan paid all-to-alls around each product. ``torch.matmul`` on the 4D
tensors is captured as ``torchalpa::batched_matmul`` (``torchalpa/ops/batched_matmul.py``),
which keeps each batch dim its own; this rewrite makes the ``bmm`` spelling the same,
exactly, on the traced step (forward and backward):

- ``permute(view(y, (n0 * n1, a, b)), (0, 2, 1))`` -> ``reshape(permute(y, (0, 1, 3, 2)),
  (n0 * n1, b, a))``, for ``y`` of shape ``(n0, n1, a, b)``: a transpose moved inside the
  merge;
- ``bmm(view(x, (n0 * n1, m, k)), view(y, (n0 * n1, k, p)))`` -> ``view(batched_matmul(x,
  y), (n0 * n1, m, p))``, for ``x``, ``y`` of batch dims ``(n0, n1)``;
- ``view(view(y, s), y.shape)`` -> ``y``.

Anything else is left as it is.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from torchalpa.ops import batched_matmul as _registers_op  # noqa: F401

__all__ = ["lift_merged_batch_products"]

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _shape(n) -> tuple[int, ...] | None:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _merged(node) -> fx.Node | None:
    """``y`` when ``node`` is ``view(y, (n0 * n1, ..))`` of a 4D ``y`` merging its first
    two dims and keeping the last two."""
    if not (isinstance(node, fx.Node) and node.target in _VIEWS):
        return None
    y = node.args[0]
    outer, inner = _shape(y), _shape(node)
    if not isinstance(y, fx.Node) or outer is None or inner is None or len(outer) != 4 or len(inner) != 3:
        return None
    if outer[0] * outer[1] != inner[0] or outer[2:] != inner[1:] or min(outer[:2]) < 2:
        return None
    return y


def _new(g: fx.Graph, target, args, like: fx.Node, val) -> fx.Node:
    node = g.call_function(target, args)
    node.meta = dict(like.meta)
    node.meta["val"] = val
    return node


def _permute_inside(gm: fx.GraphModule, node: fx.Node) -> int:
    dims = node.args[1] if node.target is aten.permute.default else None
    if not isinstance(dims, (list, tuple)) or tuple(dims) != (0, 2, 1):
        return 0
    y = _merged(node.args[0])
    if y is None:
        return 0
    g, yv = gm.graph, y.meta["val"]
    with g.inserting_before(node):
        inner = _new(g, aten.permute.default, (y, [0, 1, 3, 2]), node, yv.permute(0, 1, 3, 2))
        # a reshape, not a view: the permuted tensor's strides may allow none (where no
        # lifted bmm takes this value, it runs as it is)
        out = _new(g, aten.reshape.default, (inner, list(node.meta["val"].shape)), node,
                   node.meta["val"])
    node.replace_all_uses_with(out)
    g.erase_node(node)
    return 1


def _lift_bmm(gm: fx.GraphModule, node: fx.Node) -> int:
    if node.target is not aten.bmm.default:
        return 0
    x, y = _merged(node.args[0]), _merged(node.args[1])
    xs, ys = _shape(x), _shape(y)
    if x is None or y is None or xs is None or ys is None or xs[:2] != ys[:2]:
        return 0
    g = gm.graph
    product = torch.ops.torchalpa.batched_matmul.default
    with g.inserting_before(node):
        lifted = _new(g, product, (x, y), node, x.meta["val"].new_empty((*xs[:3], ys[3])))
        out = _new(g, aten.view.default, (lifted, list(node.meta["val"].shape)), node,
                   node.meta["val"])
    node.replace_all_uses_with(out)
    g.erase_node(node)
    return 1


def _view_of_view(gm: fx.GraphModule, node: fx.Node) -> int:
    if node.target not in _VIEWS or not isinstance(node.args[0], fx.Node) or \
            node.args[0].target not in _VIEWS:
        return 0
    y = node.args[0].args[0]
    if not isinstance(y, fx.Node) or _shape(y) != _shape(node) or \
            y.meta["val"].dtype != node.meta["val"].dtype:
        return 0
    node.replace_all_uses_with(y)
    gm.graph.erase_node(node)
    return 1


def lift_merged_batch_products(gm: fx.GraphModule) -> int:
    """Rewrite the forms above in place, to a fixed point; returns how many rewrites."""
    total = 0
    while True:
        done = 0
        for node in list(gm.graph.nodes):
            if node.op == "call_function":
                done += _permute_inside(gm, node) or _lift_bmm(gm, node) or \
                    _view_of_view(gm, node)
        if not done:
            break
        total += done
        gm.graph.eliminate_dead_code()
    if total:
        gm.recompile()
    return total
