"""Structural keys of layers and stages, and a cache of what was solved for them.

The pipeline search prices every layer (and, near the optimum, whole stages) with the
intra-op ILP on many submesh views. A transformer's layers are identical up to node names,
so one solve per *structure* serves them all: ``layer_signature`` hashes what an ILP
sees of a group of ops (op kinds, shapes, dtypes, arguments, how the ops read each other,
the shapes of what they read from outside the group, which outputs leave it), never the
names. Two layers with one key get the same plan on the same mesh.

``SolveCache`` keeps solved results under such keys together with everything else that
decides them (mesh view, submesh, cluster, options, in-flight micro-batches): within one
search it removes repeated solves, and across searches in one process (the remat
variants, the micro-batch counts of a benchmark, the hand grids) it reuses whatever
repeats exactly.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from torchalpa.core.opgraph import OpGraph

__all__ = ["layer_signature", "layer_signatures", "range_signature", "SolveCache"]


def layer_signature(graph: OpGraph, names: list[str]) -> str:
    """Structural identity of the ops ``names`` of ``graph`` (a layer): equal for layers
    that differ only in node names, different when an op, shape, dtype, argument, an
    edge inside the layer, the shape of an outside operand, or which values leave the layer
    differs."""
    pos = {n: i for i, n in enumerate(names)}
    inside = set(names)
    h = hashlib.sha256()
    for name in names:
        node = graph.node(name)
        operands = [pos[r.node] if r.node in pos else ("outside", str(graph.spec(r)))
                    for r in node.operands]
        operand_index = [r.index for r in node.operands]
        leaves = any(c not in inside for c in graph.consumers(name))
        h.update(repr((node.op, node.kind, [str(o) for o in node.outputs], node.args,
                       node.kwargs, operands, operand_index, node.phase, leaves)).encode())
    outputs = graph.outputs
    grads = sorted(pos[r.node] for _, r in outputs.grads if r.node in pos)
    updates = sorted(pos[r.node] for _, r in outputs.buffer_updates if r.node in pos)
    loss = [pos[r.node] for r in ([outputs.loss] if outputs.loss is not None else [])
            if r.node in pos]
    h.update(repr((grads, updates, loss)).encode())
    return h.hexdigest()[:20]


def layer_signatures(graph: OpGraph, layer: dict[str, int], num_layers: int) -> list[str]:
    """``layer_signature`` of each of the ``num_layers`` layers (``layer``: node -> layer)."""
    members: list[list[str]] = [[] for _ in range(num_layers)]
    for node in graph:
        members[layer[node.name]].append(node.name)
    return [layer_signature(graph, names) for names in members]


def range_signature(signatures: list[str], first: int, last: int) -> tuple[str, ...]:
    """Key of layers ``first..last`` as one stage: their layer keys in order (ranges of
    identical layers at different depths share it)."""
    return tuple(signatures[first:last + 1])


class SolveCache:
    """A bounded mapping key -> solved result (least recently used dropped first); ``get``
    solves on a miss. ``hits`` and ``misses`` count what it saved."""

    def __init__(self, max_entries: int = 20000):
        self.max_entries = max_entries
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def peek(self, key: Hashable) -> Any:
        """The stored result (KeyError if none), without solving."""
        return self._items[key]

    def put(self, key: Hashable, value: Any) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, key: Hashable, solve: Callable[[], Any]) -> Any:
        if key in self._items:
            self.hits += 1
            self._items.move_to_end(key)
            return self._items[key]
        self.misses += 1
        value = solve()
        self.put(key, value)
        return value

    def clear(self) -> None:
        self._items.clear()
        self.hits = self.misses = 0

