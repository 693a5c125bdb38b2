"""Fold decomposed patterns of a local program back into the one kernel eager PyTorch runs.

The capture records core ATen, where some fused kernels come out as several elementwise
ops over the same tensor. The planner wants them apart (one sharding rule per op), but at
run time each is one more pass over memory and one more dispatch. After lowering, where
sharding is settled, this pass puts the kernel back where the result is the same bit for
bit:

- ReLU's backward: ``where(le(x, t), scalar_tensor(0), grad)`` is
  ``threshold_backward(grad, x, t)`` (eager autograd's kernel; both pick ``grad`` where
  ``x > t`` or is NaN, and zero elsewhere).
- ``torchalpa::batched_matmul`` (the capture's one op for a product over several batch
  dims, so the planner gets one rule for it) runs as its body, ``matmul`` then
  ``contiguous``: a ``torch.library`` custom op goes through Python autograd and dispatch
  plumbing on every call (about 30 us on CPU, some ten calls per layer and step), which a
  lowered program, run without autograd, does not need.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import torchalpa.ops.batched_matmul  # noqa: F401  (registers torchalpa::batched_matmul)

__all__ = ["fold_relu_backward", "inline_batched_matmul"]

aten = torch.ops.aten
_BATCHED_MATMUL = torch.ops.torchalpa.batched_matmul.default


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


def inline_batched_matmul(graph: fx.Graph, keep: frozenset[fx.Node] = frozenset()) -> int:
    """Rewrite each ``torchalpa::batched_matmul(a, b)`` into ``matmul(a, b).contiguous()``
    (the op's own body, so the same kernels on the same values) in place; returns how many.
    Nodes in ``keep`` stay (the lowering holds them by reference)."""
    inlined = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not _BATCHED_MATMUL or n.kwargs or n in keep:
            continue
        with graph.inserting_before(n):
            product = graph.call_function(torch.matmul, tuple(n.args))
            dense = graph.call_method("contiguous", (product,))
        n.replace_all_uses_with(dense)
        graph.erase_node(n)
        inlined += 1
    return inlined
