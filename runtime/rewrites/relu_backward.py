"""ReLU's backward as the one kernel eager autograd runs: ``threshold_backward``.

The capture records core ATen, where ReLU's backward comes out as
``where(le(x, t), scalar_tensor(0), grad)``: three ops, the planner's to shard one by one.
After lowering, where sharding is settled, this pass puts eager's kernel back,
``threshold_backward(grad, x, t)``: one pass over memory and one dispatch instead of three.
Both pick ``grad`` where ``x > t`` or is NaN and zero elsewhere, so the gradient is the
same bit for bit.
"""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["fold_relu_backward"]

aten = torch.ops.aten


def _zero_scalar(n: object) -> bool:
    """Whether ``n`` is ``scalar_tensor(0)`` of a floating dtype."""
    if not (isinstance(n, fx.Node) and n.op == "call_function"
            and n.target is aten.scalar_tensor.default and n.args[:1] == (0,)):
        return False
    dtype = n.kwargs.get("dtype")
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def fold_relu_backward(graph: fx.Graph, keep: frozenset[fx.Node] = frozenset()) -> int:
    """Rewrite ``where(le(x, t), scalar_tensor(0), grad)`` into ``threshold_backward(grad,
    x, t)`` in place; returns how many were folded. Nodes in ``keep`` stay (the lowering
    holds them as a stage's sends or gradients)."""
    folded = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not aten.where.self or n.kwargs or n in keep:
            continue
        cond, zero, grad = n.args
        if not (isinstance(cond, fx.Node) and cond.op == "call_function"
                and cond.target is aten.le.Scalar and not cond.kwargs and _zero_scalar(zero)):
            continue
        x, threshold = cond.args
        with graph.inserting_before(n):
            fused = graph.call_function(aten.threshold_backward.default, (grad, x, threshold))
        n.replace_all_uses_with(fused)
        graph.erase_node(n)
        for dead in (cond, zero):
            if isinstance(dead, fx.Node) and not dead.users:
                graph.erase_node(dead)
        folded += 1
    return folded
