"""Shrink the ILP: followers share their operand's decision, repeated layers share one.

Two ways a node stops needing variables of its own (as in Alpa's auto-sharding):

* **Followers.** A cheap op (elementwise, view, reduction: not a matmul or convolution)
  that can read every layout of its largest operand without resharding it simply
  follows that operand: its strategy is a function of the operand's, and its other
  operands are resharded to match. Never a parameter or input: that is where layouts
  change (a gathered weight read by forward and backward should be gathered once).
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

from torchalpa.core.opgraph import OpGraph
from torchalpa.core.placement import Partial, Replicate
from torchalpa.passes.sharding.strategies import Strategy

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


def _follow_map(producer: list[Strategy], index: int, follower: list[Strategy], slot: int,
                reduce_partials: bool = True) -> tuple[int, ...] | None:
    """For each producer strategy, a follower strategy reading its output as is -- or,
    with ``reduce_partials``, reading a partial sum reduced (the all-reduce between them
    is priced on their edge, as in Megatron's row-parallel layers: a partial can only
    flow through an op whose other operands are partial too). None if some layout
    cannot be read."""
    by_input: dict = {}
    for b, s in enumerate(follower):
        by_input.setdefault(s.inputs[slot], b)
    mapping = []
    for s in producer:
        layout = s.outputs[index]
        reduced = tuple(Replicate() if isinstance(p, Partial) else p for p in layout)
        b = by_input.get(reduced, by_input.get(layout)) if reduce_partials else \
            by_input.get(layout, by_input.get(reduced))
        if b is None:
            return None
        mapping.append(b)
    return tuple(mapping)


def _operand_to_follow(graph: OpGraph, node, order: dict[str, int]) -> int | None:
    """The slot of the operand a node follows: its largest tensor operand that is not a
    parameter or input, the most recently made one on ties (Alpa follows the deepest)."""
    slots = [k for k, r in enumerate(node.operands)
             if graph.spec(r).numel > 1 and not graph.node(r.node).is_leaf]
    if not slots:
        return None
    return max(slots, key=lambda k: (graph.spec(node.operands[k]).numel,
                                     order[node.operands[k].node]))


def _attach_untagged(graph: OpGraph, blocks: dict[str, tuple[str, int]]
                     ) -> dict[str, tuple[str, int]]:
    """Backward ops outside every block (autograd's gradient accumulation, whose module tag
    is unreliable) join the block of their first operand that has one of its own, the
    same way in every block."""
    attached = dict(blocks)
    for n in graph.ops():
        if n.name not in blocks and (not n.module or n.phase == "backward"):
            for ref in n.operands:
                if ref.node in blocks:
                    attached[n.name] = blocks[ref.node]
                    break
    return attached


def _identity(memo: dict[int, tuple[int, ...]], n: int) -> tuple[int, ...]:
    """``tuple(range(n))``, made once per ``n`` (thousands of nodes share a few counts)."""
    found = memo.get(n)
    if found is None:
        found = memo[n] = tuple(range(n))
    return found


def group_nodes(graph: OpGraph, strategies: dict[str, list[Strategy]],
                blocks: dict[str, tuple[str, int]] | None = None,
                merge_followers: bool = True, fixed: frozenset = frozenset(),
                heavy: frozenset = frozenset(), period: int = 1) -> Grouping:
    """Decide which nodes share decisions. ``fixed`` nodes always keep their own, and
    ``heavy`` ones (matmuls, convolutions: where layouts are decided) never follow.
    With ``period`` p, block k shares decisions with the first block of its kind whose
    index is k mod p (p = 2 lets consecutive layers alternate, as Megatron's column- and
    row-parallel Linear layers do when each Linear is its own block)."""
    identity: dict[int, tuple[int, ...]] = {}     # one tuple per strategy count, shared
    g = Grouping(rep={n.name: n.name for n in graph},
                 index={n.name: _identity(identity, len(strategies[n.name])) for n in graph})
    blocks = _attach_untagged(graph, dict(blocks or {}))
    # 1. repeated blocks: node j of a block follows node j of the first block with the
    #    same op sequence (the first layer, say, computes no gradient for its input)
    members: dict[tuple[str, int], list[str]] = {}
    for n in graph:
        if n.name in blocks and n.name not in fixed:
            members.setdefault(blocks[n.name], []).append(n.name)
    heads: dict[tuple, list[str]] = {}
    seen_of_kind: dict[str, int] = {}
    for (kind, _idx), names in sorted(members.items(), key=lambda kv: kv[0][1]):
        ordinal = seen_of_kind.get(kind, 0)      # k-th block of this kind, whatever its index
        seen_of_kind[kind] = ordinal + 1
        signature = (kind, ordinal % period,
                     tuple((graph.node(a).op, graph.node(a).outputs, len(strategies[a]))
                           for a in names))
        head = heads.setdefault(signature, names)
        if head is not names:
            for a, b in zip(head, names):
                g.rep[b], g.index[b] = a, _identity(identity, len(strategies[b]))
    # 2. followers (in topological order, so producers are grouped first)
    if merge_followers:
        order = {n.name: i for i, n in enumerate(graph)}
        grads = {r.node for _, r in graph.outputs.grads}
        for n in graph.ops():
            if n.name in fixed or g.rep[n.name] != n.name or len(strategies[n.name]) < 2 \
                    or n.name in heavy:
                continue
            slot = _operand_to_follow(graph, n, order)
            if slot is None:
                continue
            ref = n.operands[slot]
            if ref.node in fixed or blocks.get(ref.node, (None,))[0] != blocks.get(n.name, (None,))[0]:
                continue
            # a partial flows through an op only if every other operand can be partial
            # too (summing partial gradients); otherwise reduce it first (a bias add).
            # Not into a parameter's gradient (the own part of a tied weight's gradient
            # plus the part another stage sends whole): that is reduced once per step,
            # after the last micro-batch, and the whole addend is split into a partial
            # sum for free, so reducing on the edge would run with every micro-batch
            others = [r for k, r in enumerate(n.operands)
                      if k != slot and graph.spec(r).numel > 1]
            others_partial = all(any(isinstance(p, Partial) for s in strategies[r.node]
                                     for p in s.outputs[r.index]) for r in others)
            final = n.name in grads and not graph.consumers(n.name)
            mapping = _follow_map(strategies[ref.node], ref.index, strategies[n.name], slot,
                                  reduce_partials=bool(others) and not others_partial
                                  and not final)
            if mapping is not None:
                g.compose(n.name, ref.node, mapping)
        # block copies follow whatever their head now follows (a copy reads its head's
        # strategies in order: it takes the head's index as it is)
        for name, rep in list(g.rep.items()):
            if rep != name and g.rep.get(rep, rep) != rep:
                index = g.index[name]
                if index is _identity(identity, len(index)):
                    g.rep[name], g.index[name] = g.rep[rep], g.index[rep]
                else:
                    g.compose(name, rep, index)
    return g
