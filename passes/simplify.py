"""Shrink the ILP: followers share their operand's decision, repeated layers share one.

Two ways a node stops needing variables of its own (as in Alpa's auto-sharding):

* **Followers.** A node with a single tensor operand (a view, an elementwise op with only
  scalars beside) that can read every layout its operand may produce, without
  resharding, simply follows it: its strategy is a function of the operand's. Not when
  the operand is a parameter or input: that is where layouts change (a gathered weight
  read by forward and backward should be gathered once).
* **Repeated blocks.** Layers that are the same ops on the same shapes (``blocks`` maps a
  node to its block kind and index) make the same decision: node ``j`` of every block
  follows node ``j`` of the first block of its kind.

The result is a ``Grouping``: each node's representative and the map from the
representative's strategy index to the node's. The ILP gets variables for
representatives only; costs of everything else fold onto them. A restriction of the
full problem, so any plan it finds is a valid plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchalpa.opgraph import OpGraph
from torchalpa.passes.strategies import Strategy

__all__ = ["Grouping", "group_nodes"]


@dataclass
class Grouping:
    rep: dict[str, str]                  # node -> representative node
    index: dict[str, tuple[int, ...]]    # node -> its strategy index for each rep index

    @property
    def representatives(self) -> list[str]:
        seen = dict.fromkeys(self.rep.values())
        return list(seen)

    def compose(self, node: str, via: str, mapping: tuple[int, ...]) -> None:
        """Make ``node`` follow ``via`` (already grouped) through ``mapping``."""
        self.rep[node] = self.rep[via]
        self.index[node] = tuple(mapping[i] for i in self.index[via])


def _follow_map(producer: list[Strategy], index: int, follower: list[Strategy], slot: int
                ) -> tuple[int, ...] | None:
    """For each producer strategy, a follower strategy reading its output as is."""
    by_input: dict = {}
    for b, s in enumerate(follower):
        by_input.setdefault(s.inputs[slot], b)
    mapping = []
    for s in producer:
        b = by_input.get(s.outputs[index])
        if b is None:
            return None
        mapping.append(b)
    return tuple(mapping)


def _single_operand(graph: OpGraph, node) -> int | None:
    """The slot of the node's only non-scalar tensor operand, if it has exactly one."""
    slots = [k for k, r in enumerate(node.operands) if graph.spec(r).numel > 1]
    return slots[0] if len(slots) == 1 else None


def _attach_untagged(graph: OpGraph, blocks: dict[str, tuple[str, int]]
                     ) -> dict[str, tuple[str, int]]:
    """Ops autograd adds without a module (gradient accumulation) join the block of their
    first operand that has one of its own, the same way in every block."""
    attached = dict(blocks)
    for n in graph.ops():
        if n.name not in blocks and not n.module:
            for ref in n.operands:
                if ref.node in blocks:
                    attached[n.name] = blocks[ref.node]
                    break
    return attached


def group_nodes(graph: OpGraph, strategies: dict[str, list[Strategy]],
                blocks: dict[str, tuple[str, int]] | None = None,
                merge_followers: bool = True, fixed: frozenset = frozenset()) -> Grouping:
    """Decide which nodes share decisions. ``fixed`` nodes always keep their own."""
    g = Grouping(rep={n.name: n.name for n in graph},
                 index={n.name: tuple(range(len(strategies[n.name]))) for n in graph})
    blocks = _attach_untagged(graph, dict(blocks or {}))
    # 1. repeated blocks: node j of a block follows node j of the first block with the
    #    same op sequence (the first layer, say, computes no gradient for its input)
    members: dict[tuple[str, int], list[str]] = {}
    for n in graph:
        if n.name in blocks and n.name not in fixed:
            members.setdefault(blocks[n.name], []).append(n.name)
    heads: dict[tuple, list[str]] = {}
    for (kind, _), names in sorted(members.items(), key=lambda kv: kv[0][1]):
        signature = (kind, tuple((graph.node(a).op, graph.node(a).outputs, len(strategies[a]))
                                 for a in names))
        head = heads.setdefault(signature, names)
        if head is not names:
            for a, b in zip(head, names):
                g.rep[b], g.index[b] = a, tuple(range(len(strategies[b])))
    # 2. followers (in topological order, so producers are grouped first)
    if merge_followers:
        for n in graph.ops():
            if n.name in fixed or g.rep[n.name] != n.name or len(strategies[n.name]) < 2:
                continue
            slot = _single_operand(graph, n)
            if slot is None:
                continue
            ref = n.operands[slot]
            if graph.node(ref.node).is_leaf:
                continue  # layouts change right after parameters/inputs (gathers, slices)
            if ref.node in fixed or blocks.get(ref.node, (None,))[0] != blocks.get(n.name, (None,))[0]:
                continue
            mapping = _follow_map(strategies[ref.node], ref.index, strategies[n.name], slot)
            if mapping is not None:
                g.compose(n.name, ref.node, mapping)
        # block copies follow whatever their head now follows
        for name, rep in list(g.rep.items()):
            if rep != name and g.rep.get(rep, rep) != rep:
                g.compose(name, rep, g.index[name])
    return g
