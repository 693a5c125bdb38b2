"""Activation checkpointing per pipeline stage: what a recomputed stage costs.

The stage DP prices every candidate stage twice, its activations kept and recomputed,
and keeps the better one per stage (``passes/pipeline_search/stage_search.py``); the runtime runs a
recomputed stage by keeping each micro-batch's inputs and running its forward again
right before its backward (``runtime/execution/stage_replay.py``). Under the cost model:

- time: one more forward per micro-batch. A stage's backward is about twice its forward
  (the convention the pipeline timeline uses), so the forward is a third of its step
  time, collectives included (the recompute repeats forward's collectives too);
- memory: while one micro-batch is at its peak (its recomputed activations plus one
  op's working set: the peak of the kept plan), each other micro-batch in flight holds
  only the activations the stage received for it (its slice of the user's batch is held
  by the runner whether or not the stage checkpoints).

A stage planned for recomputation is planned with one micro-batch in flight and a
budget lowered by the inputs of the others, so its intra-op plan is exact under that
accounting.
"""

from __future__ import annotations

from torchalpa.core.opgraph import OpGraph

__all__ = ["FORWARD_SHARE", "recompute_seconds", "recompute_memory", "received_bytes"]

FORWARD_SHARE = 1 / 3
"""A forward's share of a stage's step time (backward is about twice forward's work)."""


def recompute_seconds(step_seconds: float) -> float:
    """A recomputed stage's seconds per micro-batch: its step plus one more forward."""
    return step_seconds * (1 + FORWARD_SHARE)


def recompute_memory(state: float, peak: float, inputs: float, in_flight: int) -> float:
    """Bytes per device of a recomputed stage holding ``in_flight`` micro-batches: model
    states, one micro-batch at its peak, the others' received activations."""
    return state + peak + (in_flight - 1) * inputs


def received_bytes(graph: OpGraph, inside) -> float:
    """Bytes of the forward values a stage receives per micro-batch: made by a forward op
    outside it (``inside(name)`` is False), read by a forward op inside. Counted whole
    (as the receiving runtime holds them at most), parameters and user inputs excluded."""
    seen: set = set()
    total = 0.0
    for node in graph.ops():
        if node.phase != "forward" or not inside(node.name):
            continue
        for ref in node.operands:
            producer = graph.node(ref.node)
            if ref in seen or producer.is_leaf or inside(ref.node) or \
                    producer.phase != "forward":
                continue
            seen.add(ref)
            total += graph.spec(ref).nbytes
    return total


def stage_recompute_allowed(method, graph: OpGraph) -> bool:
    """Whether the pipeline search prices stages recomputed: with ``remat="auto"``, on a
    capture not already checkpointed layer by layer (``remat="none"`` never recomputes;
    ``"full"`` plans the checkpointed capture)."""
    return method.auto_sharding_option.remat == "auto" and \
        (graph.meta.get("remat") or {}).get("mode") != "full"


def recompute_option(option, budget: float | None, received: float, in_flight: int):
    """``option`` for planning a recomputed stage with one micro-batch in flight: its
    budget lowered by what the other ``in_flight - 1`` micro-batches keep (None: nothing
    is left for the stage's own plan)."""
    from dataclasses import replace
    if not budget:
        return option
    left = budget - (in_flight - 1) * received
    return replace(option, memory_budget_per_device=left) if left > 0 else None
