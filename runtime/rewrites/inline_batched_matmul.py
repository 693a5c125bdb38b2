"""``torchalpa::batched_matmul`` run as its body in a lowered program.

The capture records a product over several batch dims as one custom op,
``torchalpa::batched_matmul``, so the planner gets one sharding rule for it. A
``torch.library`` custom op goes through Python autograd and dispatch plumbing on every call
(about 30 us on CPU, some ten calls per layer and step), which a lowered program, run
without autograd, does not need. After lowering this pass replaces each call by the op's
own body, ``matmul`` then ``contiguous``: the same kernels on the same values.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import torchalpa.ops.batched_matmul  # noqa: F401  (registers torchalpa::batched_matmul)

__all__ = ["inline_batched_matmul"]

_BATCHED_MATMUL = torch.ops.torchalpa.batched_matmul.default


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
