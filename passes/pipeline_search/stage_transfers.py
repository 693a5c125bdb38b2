"""What crosses between pipeline stages, and how often.

Activations (and their gradients) cross the cut between two stages once per micro-batch.
A parameter read by another stage, or a gradient part another stage only adds into a
parameter's gradient, crosses once per step (``once_per_step``). Gradients and buffer
updates made outside their owner's stage go to the owner (``owner_transfers``).
"""

from __future__ import annotations

from torchalpa.core.opgraph import OpGraph
from torchalpa.core.plan import Transfer
from torchalpa.passes.pipeline_search.subgraph import StageGraph, once_per_step

__all__ = ["once_per_step", "stage_transfers", "owner_transfers"]


def stage_transfers(graph: OpGraph, node_stage: dict[str, int], subs: list[StageGraph]
                    ) -> list[Transfer]:
    """Every value a stage sends to a later or earlier one (``subs``: each stage's own
    graph, with what it sends), then the gradients and buffer updates going to their
    owners."""
    transfers = []
    for s, sub in enumerate(subs):
        for ref in sub.sends:
            for t in sorted({node_stage[c] for c in graph.consumers(ref.node)} - {s}):
                transfers.append(Transfer(producer=ref.node, index=ref.index, src_stage=s,
                                          dst_stage=t, phase=graph.node(ref.node).phase,
                                          bytes=graph.spec(ref).nbytes,
                                          once_per_step=once_per_step(graph, ref, node_stage,
                                                                      t)))
    return transfers + owner_transfers(graph, node_stage, transfers)


def owner_transfers(graph: OpGraph, node_stage: dict, have: list[Transfer]) -> list[Transfer]:
    """Gradients (and buffer updates) made outside their owner's stage go to the owner."""
    known = {(t.producer, t.index, t.dst_stage) for t in have}
    params = graph.params
    buffers = {n.target: n.name for n in graph if n.kind == "buffer"}
    out = []
    for leaf, ref in [(params[f], r) for f, r in graph.outputs.grads] + \
            [(buffers[f], r) for f, r in graph.outputs.buffer_updates]:
        src, dst = node_stage[ref.node], node_stage[leaf]
        if src != dst and (ref.node, ref.index, dst) not in known:
            known.add((ref.node, ref.index, dst))
            out.append(Transfer(ref.node, ref.index, src, dst, graph.node(ref.node).phase,
                                graph.spec(ref).nbytes))
    return out
