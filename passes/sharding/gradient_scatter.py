"""Alpa's ``prefer_reduce_scatter``: after the ILP, gradients' all-reduces become
reduce-scatters.

Alpa solves its ILP as without the option (gradients all-reduced where a parameter is
whole on a mesh axis that splits the batch) and then rewrites each such all-reduce into a
reduce-scatter, the optimizer update running on the scattered piece and the updated
parameter gathered back to the layout the ILP chose. Here that is one change of the
solved plan: each such parameter is stored split on that axis too, so its gradient
reaches it by a reduce-scatter, and its first read in a step gathers it (one phase of
all-gathers, as Alpa's after the update; with ``rematerialize_parameters`` its backward
reads gather it again, Alpa's ``force_zero_stage_3``). The ILP's objective is the plan's
without the rewrite, as Alpa's is; the plan's step estimate prices what it issues.

A dim no other axis splits is split first, then a dim only earlier axes split (the axis
splits each of their pieces: the ordinary ``(Shard(d), Shard(d))``). Where every dim is taken (a column-parallel
bias of a 2D plan: its one dim split on the model axis 1), the parameter is split on the
batch axis 0 inside each of axis 1's pieces, as Alpa's rewrite splits it: a nested
strided shard (DTensor's ``(_StridedShard(d, k), Shard(d))``, ``reshard.nested_strided``),
into which the gradient's partial sum on axis 0 reduce-scatters and from which forward's
read gathers on axis 0 alone, each a plain shard's collective on a rank's piece. A
parameter is left as the ILP chose it where no layout splits it on that axis too (not
divisible, or a pin): its gradient stays all-reduced, as Alpa's stays where its rewrite
finds no split.
"""

from __future__ import annotations

import re

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph, TensorSpec
from torchalpa.core.placement import (
    Partial,
    Placements,
    Replicate,
    Shard,
    is_shard,
    split_factor_of,
    strided,
)
from torchalpa.passes.sharding.costgraph import ReshardCosts
from torchalpa.passes.sharding.reshard import nested_strided, plan_reshard
from torchalpa.passes.sharding.strategies import Strategy, leaf_strategies

__all__ = ["scatter_gradients"]


def scatter_gradients(graph: OpGraph, mesh: LogicalMesh, strategies: dict[str, list[Strategy]],
                      chosen: dict[str, Strategy], costs: ReshardCosts, pins: tuple = ()
                      ) -> tuple[dict[str, Strategy], ReshardCosts]:
    """``chosen`` with each parameter whose gradient is all-reduced on a mesh axis stored
    split on that axis too, and the resharding costs under which its gradient reaches it
    by reduce-scatter and its reads gather it. A parameter ``pins`` (``option.pin``)
    matches keeps its layout; the others may take any even split, as Alpa's rewrite comes
    after whatever kept its ILP's parameters whole (``force_data_parallel``: its ZeRO)."""
    chosen = dict(chosen)
    pinned = [re.compile(p) for p, _ in pins]
    params = graph.params
    users: dict[tuple[str, int], int] = {}
    for n in graph.ops():
        for r in n.operands:
            users[(r.node, r.index)] = users.get((r.node, r.index), 0) + 1
    scattered: set[tuple[TensorSpec, Placements]] = set()
    for fqn, ref in graph.outputs.grads:
        name = params[fqn]
        sunk = _sink_reduction(graph, strategies, chosen, ref.node, users)
        node = graph.node(name)
        options = strategies[name] if any(p.fullmatch(node.target or name) for p in pinned) \
            else leaf_strategies(node.output, mesh)
        grad = sunk.get(ref.node, chosen[ref.node]).outputs[ref.index]
        new = _split_further(node.output, grad, chosen[name].outputs[0], mesh, options)
        if new is not None:     # else the ILP's plan stands, its reduction where it was
            chosen.update(sunk)
            chosen[name] = new
            scattered.add((node.output, new.outputs[0]))
    if not scattered:
        return chosen, costs
    return chosen, _ScatteredCosts(costs, frozenset(scattered))


def _split_further(spec: TensorSpec, grad: Placements, stored: Placements,
                   mesh: LogicalMesh, options: list[Strategy]) -> Strategy | None:
    """The layout of ``options`` that is ``stored`` with every axis on which ``grad`` is a
    partial sum and ``stored`` whole split on a dim no other axis splits (the lowest such
    dim), if there is one."""
    axes = [a for a, (g, s) in enumerate(zip(grad, stored))
            if isinstance(g, Partial) and isinstance(s, Replicate) and mesh.shape[a] > 1]
    if not axes:
        return None
    taken = {p.dim for p in stored if is_shard(p)}
    by_layout = {s.outputs[0]: s for s in options}
    want = list(stored)
    for a in axes:
        # a free dim first; then a dim only earlier axes split, plainly: ``a`` splits each
        # of their pieces, the ordinary layout (``(S(0), S(0))``); else a nested shard
        for d in [d for d in range(len(spec.shape)) if d not in taken] + \
                [d for d in sorted(taken) if _only_earlier(want, d, a)]:
            trial = want.copy()
            trial[a] = Shard(d)
            if tuple(trial) in by_layout:
                want, taken = trial, taken | {d}
                break
        else:
            want = _nest(spec, want, a, mesh)
    if tuple(want) == tuple(stored):
        return None
    found = by_layout.get(tuple(want))
    if found is None and any(nested_strided(tuple(want), a, mesh.shape) for a in axes):
        shards = 1
        for n, p in zip(mesh.shape, want):
            shards *= n if is_shard(p) else 1
        found = Strategy(inputs=(), outputs=(tuple(want),), shards=shards)
    return found


def _only_earlier(want: list, d: int, axis: int) -> bool:
    """Whether every axis of ``want`` splitting dim ``d`` comes before ``axis`` and splits
    it plainly, so that ``Shard(d)`` on ``axis`` splits each of their pieces."""
    return all(b < axis and split_factor_of(p) == 1
               for b, p in enumerate(want) if b != axis and is_shard(p) and p.dim == d)


def _nest(spec: TensorSpec, want: list, axis: int, mesh: LogicalMesh) -> list:
    """``want`` with ``axis`` splitting, inside each piece, the lowest dim that only later
    axes split, plainly (a nested strided shard: ``reshard.nested_strided``), if its pieces
    divide; else ``want``."""
    for d in range(len(spec.shape)):
        others = [b for b, p in enumerate(want) if b != axis and is_shard(p) and p.dim == d]
        if not others or any(b < axis or split_factor_of(want[b]) != 1 for b in others):
            continue
        pieces = 1
        for b in others:
            pieces *= mesh.shape[b]
        if spec.shape[d] % (pieces * mesh.shape[axis]) == 0:
            trial = want.copy()
            trial[axis] = strided(d, pieces)
            return trial
    return want


def _sink_reduction(graph: OpGraph, strategies: dict[str, list[Strategy]],
                    chosen: dict[str, Strategy], name: str, users: dict
                    ) -> dict[str, Strategy]:
    """Move a gradient's all-reduce to its end: where the ILP reduced it before the views
    that make the gradient (a transpose of a product's result, read whole), let each view
    read the partial sum and pass it on (a strategy it has), so that the sum reaches the
    parameter's reshard as a partial sum, as in Alpa's HLO, where the rewrite finds it.
    The views' new strategies, by node."""
    chain, sunk = [], {}
    node = graph.node(name)
    while node.kind not in ("param", "buffer", "input") and len(node.operands) == 1 \
            and len(node.outputs) == 1 and users.get((node.operands[0].node,
                                                      node.operands[0].index)) == 1:
        chain.append(node)
        node = graph.node(node.operands[0].node)
    for n in reversed(chain):
        ref = n.operands[0]
        src = sunk.get(ref.node, chosen[ref.node]).outputs[ref.index]
        current = chosen[n.name]
        read = current.inputs[0]
        if read is None or read == src or len(current.outputs) != 1:
            continue
        want = tuple(s if isinstance(s, Partial) and isinstance(i, Replicate) else o
                     for s, i, o in zip(src, read, current.outputs[0]))
        for option in strategies[n.name]:
            if option.inputs[0] == src and option.outputs[0] == want:
                sunk[n.name] = option
                break
    return sunk


class _ScatteredCosts(ReshardCosts):
    """``costs``, but a value laid out as a rewritten parameter, or read from one, is
    resharded with reduce-scatters and all-gathers whatever the ILP's space allowed (they
    come after the ILP, as Alpa's rewrite does)."""

    def __init__(self, costs: ReshardCosts, scattered: frozenset):
        super().__init__(costs.mesh, costs.allow_reduce_scatter, costs.forbidden)
        self.scattered = scattered

    def steps(self, spec: TensorSpec, src: Placements, dst: Placements | None):
        if dst is not None and ((spec, dst) in self.scattered or (spec, src) in self.scattered) \
                and all(split_factor_of(p) == 1 or nested_strided(layout, a, self.mesh.shape)
                        for layout in (src, dst) for a, p in enumerate(layout)):
            return plan_reshard(spec, src, dst, self.mesh.shape, True,
                                "all_to_all" not in self.forbidden)
        return super().steps(spec, src, dst)
