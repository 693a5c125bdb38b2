"""What crosses between pipeline stages, and how often.

Activations (and their gradients) cross the cut between two stages once per micro-batch.
A parameter read by another stage, or a gradient part another stage only adds into a
parameter's gradient, crosses once per step (``once_per_step``). Gradients and buffer
updates made outside their owner's stage go to the owner (``owner_transfers``).

A batch-first value crossing every micro-batch between two stages of the same logical
mesh goes batch-split (``batch_splits``: each rank sends its own block of the batch to
the rank at its position; both stages' plans were solved for that layout,
``passes/sharding/stage_boundary.py``); elsewhere it is made whole by its sender.
A value crossing every micro-batch is sent in chunks where that is cheaper
(``scatter_gather``, Megatron's scatter-gather optimization): the sender holds it whole,
each rank of the receiving stage is sent only its chunk (one of as many as the ranks of
its stage mesh's last axis, the tensor-parallel one, inside a node), and the receivers
all-gather the chunks over that axis. ``transfer_seconds`` prices a transfer either way.
"""

from __future__ import annotations

from dataclasses import replace

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph, ValueRef
from torchalpa.core.plan import Transfer
from torchalpa.passes.pipeline_search.subgraph import StageGraph, once_per_step, received_name
from torchalpa.passes.pricing.cost import collective_cost
from torchalpa.passes.sharding.stage_boundary import batch_split_of

__all__ = ["once_per_step", "stage_transfers", "owner_transfers", "scatter_gather",
           "transfer_seconds", "batch_splits"]


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


def transfer_seconds(t: Transfer, meshes: list[LogicalMesh], link: float) -> float:
    """Seconds of one crossing of ``t`` (``link``: bytes per second between two stages;
    ``meshes``: each stage's logical mesh): its chunk sent to each receiving rank, then,
    split, the receivers' all-gather over their last mesh axis."""
    seconds = t.bytes_per_receiver() / link
    if t.split > 1:
        mesh = meshes[t.dst_stage]
        seconds += collective_cost(mesh, "all_gather", len(mesh.shape) - 1,
                                   t.bytes_per_receiver())
    return seconds


def batch_splits(graph: OpGraph, transfers: list[Transfer], subs: list[StageGraph],
                 meshes: list[LogicalMesh]) -> list[Transfer]:
    """``transfers`` with each value that may cross batch-split (both stage graphs'
    ``meta["batch_split"]``) split over the first mesh axis (``Transfer.batch_split``)
    where its two stages have the same logical mesh; where they do not, the value is
    struck from both stages' lists (it crosses whole, and their plans are solved so)."""
    def names(t: Transfer) -> tuple[str, str]:
        ref = ValueRef(t.producer, t.index)
        return str(ref), received_name(ref)

    def listed(t: Transfer) -> bool:
        sent, received = names(t)
        return sent in subs[t.src_stage].graph.meta.get("batch_split", ()) and \
            received in subs[t.dst_stage].graph.meta.get("batch_split", ())

    apart = {(t.producer, t.index) for t in transfers if listed(t) and
             meshes[t.src_stage].shape != meshes[t.dst_stage].shape}
    for t in transfers:     # a value sent whole to one stage is sent whole to every one
        if (t.producer, t.index) in apart:
            for s, name in zip((t.src_stage, t.dst_stage), names(t)):
                meta = subs[s].graph.meta
                meta["batch_split"] = frozenset(meta.get("batch_split", ())) - {name}
    out = []
    for t in transfers:
        n = batch_split_of(graph.spec(ValueRef(t.producer, t.index)),
                           meshes[t.dst_stage].shape)
        out.append(replace(t, batch_split=n) if listed(t) and not t.once_per_step and n > 1
                   else t)
    return out


def scatter_gather(graph: OpGraph, transfers: list[Transfer], meshes: list[LogicalMesh],
                   link: float) -> list[Transfer]:
    """``transfers`` with each value crossing every micro-batch split over the last mesh
    axis of its receiving stage (``Transfer.split``) where its elements divide evenly and
    sending chunks then gathering them is priced below sending it whole."""
    out = []
    for t in transfers:
        mesh = meshes[t.dst_stage]
        n = mesh.shape[-1]
        # a batch-split value is chunked over the last axis when that is another axis
        if not t.once_per_step and n > 1 and (t.batch_split == 1 or len(mesh.shape) > 1) \
                and graph.spec(ValueRef(t.producer, t.index)).numel // t.batch_split % n == 0:
            split = replace(t, split=n)
            if transfer_seconds(split, meshes, link) < transfer_seconds(t, meshes, link):
                t = split
        out.append(t)
    return out
