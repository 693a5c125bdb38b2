"""Where a strided shard may travel: the ops around a dim cut into equal pieces.

A fused projection whose output is cut into ``k`` equal pieces (nanoGPT's and GPT-2's
``q, k, v = c_attn(x).split(H, dim=-1)``) splits by heads only if every device holds its
block of every piece: a strided shard (``placement.strided(dim, k)``) of the projection's
output, its weight, its bias and their gradients. The split's rule offers it; the ops
between the split (or, in backward, the ``cat`` of the pieces' gradients) and the
parameter must offer it too. Any op that treats each position of a dim alike (matmuls,
views, transposes, elementwise arithmetic, sums over other dims) computes the same
thing whichever positions a device holds, so it may read and write that dim strided;
ops that address positions (embedding lookups, gathers, slices, masks built from
positions) may not.

``strided_regions`` walks from each such cut (an equal split or cat, or a view as
(pieces, heads, head dim), as timm writes attention) through such ops, along tensors
that have a dim of the cut dim's size, and, where the walk reaches a parameter, gives
every op it reached the ``(k, size)`` pairs its strategies may use (a cut with no
parameter (or gradient) in reach, such as rotary embedding's half swap, has nothing to
hold strided). Everything else is enumerated as before: the extra strategies stay where
they can pay off, and graphs without such a cut are unchanged.
"""

from __future__ import annotations

import math
from collections import deque

from torchalpa.core.opgraph import OpGraph
from torchalpa.passes.rules import rule_for

__all__ = ["strided_regions", "POSITION_FREE_OPS"]

_MAX_PIECES = 8   # a fused q/k/v has 3, a fused gate/up 2; more pieces are no projection

POSITION_FREE_OPS = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
    "aten.t.default", "aten.permute.default", "aten.transpose.int",
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
    "aten.expand.default", "aten.clone.default", "aten._to_copy.default", "aten.alias.default",
    "aten.detach.default", "aten.contiguous.default",
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor",
    "aten.mul.Scalar", "aten.div.Scalar", "aten.add.Scalar", "aten.neg.default",
    "aten.sum.dim_IntList",
    "aten.split.Tensor", "aten.split_with_sizes.default", "aten.cat.default",
})
"""Ops whose result at a position of a dim depends only on the operands at that position
(or sums over all of them): a consistent reordering of the dim's positions on every
operand and result gives the same reordering of the result."""

_CUTS = frozenset({"aten.split.Tensor", "aten.split_with_sizes.default", "aten.cat.default",
                   "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"})
"""Ops whose rules may read a dim as pieces (``FactorRule.strided``)."""


def _equal_cut(node, graph: OpGraph) -> tuple[int, int] | None:
    """(pieces, whole size) where ``node``'s rule lets a factor be split as a strided shard
    of a dim (an equal split or cat, a view as (pieces, heads, head dim)), else None."""
    if node.op not in _CUTS:
        return None
    rule = rule_for(node, graph)
    if rule is None or not rule.strided:
        return None
    size_of = rule.size_of
    for dims in rule.operands + rule.results:
        for factors in dims:
            real = [f for f in factors if size_of[f] != 1]
            for j, f in enumerate(real):
                if j and f in rule.strided:
                    pieces = math.prod(size_of[g] for g in real[:j])
                    if 2 <= pieces <= _MAX_PIECES:
                        return pieces, math.prod(size_of[g] for g in real)
    return None


def _holds_state(node, forward_only: bool) -> bool:
    """A parameter or its gradient; in a forward-only capture (no parameters: they are
    state like buffers there, and ``predict``'s program pins them to the layouts training
    holds them in, strided ones included), any state it reads."""
    return node.is_param or node.is_grad or (forward_only and node.kind == "buffer")


def strided_regions(graph: OpGraph) -> dict[str, tuple[tuple[int, int], ...]]:
    """Node name -> the (pieces, size) strided splits its strategies may use."""
    found: dict[str, set[tuple[int, int]]] = {}
    forward_only = not graph.params
    for start in graph:
        cut = _equal_cut(start, graph)
        if cut is None:
            continue
        _, size = cut
        queue, seen = deque([start.name]), {start.name}
        while queue:
            name = queue.popleft()
            node = graph.node(name)
            # the tensor on each edge must have a dim of the cut dim's size to carry it
            neighbours = [r.node for r in node.operands if size in graph.spec(r).shape]
            if any(size in out.shape for out in node.outputs):
                neighbours += graph.consumers(name)
            for other in neighbours:
                if other in seen:
                    continue
                peer = graph.node(other)
                if peer.is_leaf or peer.op in POSITION_FREE_OPS:
                    seen.add(other)
                    queue.append(other)
        if not any(_holds_state(graph.node(name), forward_only) for name in seen):
            continue    # no parameter to hold strided (a rotary half-swap): nothing to gain
        for name in seen:
            found.setdefault(name, set()).add(cut)
    return {name: tuple(sorted(cuts)) for name, cuts in found.items()}
