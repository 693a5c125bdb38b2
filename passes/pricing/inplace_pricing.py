"""Price the writes into state that the runtime does in place.

A captured step is functional: a KV cache's new entries become ``index_put(cache, slots,
values)``, a new tensor the size of the whole cache, which the op would read and write
whole. Generation's runtime writes them where the cache lies instead
(``runtime.serving.inference_module.write_cache_in_place``: the cache block's only reader is the write),
moving only the new entries. A frontend or orchestration that will run a step so names
those buffers in ``graph.meta[IN_PLACE]``; here each such write is priced as what it
moves: its indices and values read, its values written. (Memory is not changed: the
planner still counts the new value as a tensor of its own, one cache too many, which
errs on the side of fitting.)
"""

from __future__ import annotations

from dataclasses import replace

from torchalpa.core.opgraph import OpGraph

__all__ = ["IN_PLACE", "priced_in_place"]

IN_PLACE = "in_place_buffers"
"""``graph.meta`` key: the buffers (FQNs) whose writes the runtime makes in place."""

_WRITES = frozenset({"aten.index_put.default"})


def priced_in_place(graph: OpGraph) -> OpGraph:
    """``graph`` with each in-place write of a buffer named in ``graph.meta[IN_PLACE]``
    priced as the entries it moves: an ``index_put`` whose base is the buffer, which no
    other op reads, and whose result is the buffer's new value."""
    names = set(graph.meta.get(IN_PLACE, ()))
    if not names:
        return graph
    new_value = {ref.node: fqn for fqn, ref in graph.outputs.buffer_updates
                 if fqn in names and ref.index == 0}
    nodes = []
    for node in graph:
        fqn = new_value.get(node.name)
        if fqn is not None and node.op in _WRITES and node.operands:
            base = graph.node(node.operands[0].node)
            if base.kind == "buffer" and base.target == fqn and \
                    graph.consumers(base.name) == [node.name]:
                moved = sum(graph.spec(ref).nbytes for ref in node.operands[1:])
                node = replace(node, bytes=float(2 * moved))
        nodes.append(node)
    return OpGraph(nodes, graph.outputs, meta=dict(graph.meta))
