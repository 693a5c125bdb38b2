"""Typed records for what a plan predicts and why it chose each layout.

``Estimates`` holds the planner's predictions for one step (seconds, bytes per device)
and how the search went; ``Explanation`` says, per parameter, what its chosen layout
costs and what the runner-up would. Both are frozen, name every field they may hold, and
are written to and read from the plan's JSON here only (``to_dict`` / ``from_dict``), in
the same form plan files of versions 1 and 2 already use: an unknown key in a file or a
misspelled one in code is an error naming it, not a value nobody reads.

Fields are read as attributes (``est.step_time_s``; None when unset); a pass that adds a
figure makes a new record with ``dataclasses.replace(est, objective=...)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

__all__ = ["Estimates", "Explanation", "LayoutCost", "explanations_from_dict",
           "explanations_to_dict", "known"]

T = TypeVar("T")


def known(value: T | None) -> T:
    """An estimate the planner that made the record always sets (an intra-op plan's step
    time and memory, read by the passes that combine plans): the value, never None."""
    if value is None:
        raise ValueError("a plan's estimates lack a figure its planner always sets: the plan "
                         "was made by another planner or edited; plan it again")
    return value


@dataclass(frozen=True)
class Estimates:
    """A plan's predictions; a field is None when the planner that made it does not set it."""

    # one step of an intra-op plan (one micro-batch), from the cost model
    step_time_s: float | None = None
    communication_s: float | None = None
    compute_s: float | None = None
    once_per_step_s: float | None = None
    """The part of ``step_time_s`` a step pays once however many micro-batches it runs:
    the gradients' final resharding and the optimizer (a pipeline stage pays it after its
    last backward, not per micro-batch)."""
    hidden_communication_s: float | None = None
    """Communication seconds the runtime overlaps with compute (GPUs: prefetched parameter
    gathers, gradients reduced during backward): ``communication_s`` less what
    ``step_time_s`` pays (``passes/pricing/overlap_price.py``)."""
    hidden_gradient_s: float | None = None
    """Of those, the gradients' final resharding hidden behind backward (one micro-batch,
    one stage): a pipeline stage, which reduces after its last backward, pays it."""
    host_s: float | None = None
    """Host seconds an eager program spends issuing one step's ops (GPUs,
    ``LogicalMesh.host_op_s``): ``step_time_s`` is at least this."""
    model_state_bytes_per_device: float | None = None
    activation_bytes_per_device: float | None = None
    saved_activation_bytes_per_device: float | None = None
    end_of_step_bytes_per_device: float | None = None
    """Bytes at the optimizer step: parameters, optimizer states, the reduced gradients and
    the update's temporaries (``passes/pricing/step_end.py``), or, where the step sums
    micro-batches, where it reduces the sums just before, or where it gathers its
    parameters once before its first micro-batch (the same leaves held between two steps),
    if more (``passes/pricing/sum_reduction.py``, ``passes/pricing/state_gather.py``);
    ``memory_per_device_bytes`` is at least this."""
    memory_per_device_bytes: float | None = None
    wire_bytes_per_step: float | None = None
    flops_per_step: float | None = None
    """Flops of one step over all devices; with ``peak_flops_per_device``, a measured MFU."""
    peak_flops_per_device: float | None = None
    gradient_buckets: list | None = None
    """Gradient collectives issued together: axis, bytes, tensors, collective positions."""
    # the search
    objective: float | None = None
    solve_seconds: float | None = None
    ilp_seconds: float | None = None
    ilp_variables: int | None = None
    num_strategies: int | None = None
    num_decisions: int | None = None
    memory_budget_bytes: float | None = None
    memory_budget_per_device_bytes: float | None = None
    # optimizer states offloaded to host memory (``AutoShardingOption.offload``)
    offload_s: float | None = None
    """The part of ``step_time_s`` the offload pays: the host link and the host's step."""
    host_bytes_per_node: float | None = None
    """Host memory the offloaded parameter copies and optimizer states take per node."""
    streamed_bytes_per_device: float | None = None
    """With parameters offloaded, the copies streamed to a device that it holds at once
    (``passes/pricing/offload_price.py``), counted in ``memory_per_device_bytes``."""
    # a pipeline (PipelinePlan): per stage, the schedule's timeline, the stage search
    max_stage_s: float | None = None
    stage_step_s: list | None = None
    stage_times: str | None = None
    """"measured" (stage_option="profile") or "cost model"."""
    alpa_objective_s: float | None = None
    stage_memory_bytes: list | None = None
    timeline: list | None = None
    search_seconds: float | None = None
    layer_solves: int | None = None
    layers_repriced: int | None = None
    """(layer, view) estimates priced with the plan solved for another view of the class
    (``passes/pipeline_search/view_classes.py``), without an ILP."""
    stage_solves: int | None = None
    """Stages the DP picked, priced with their own memory-limited ILP (cached)."""
    total_seconds: float | None = None
    # generation (``mode="inference"``): the decode step is the plan's step
    weight_bytes_per_device: float | None = None
    """The model's parameters and buffers held on each device."""
    kv_cache_bytes_per_device: float | None = None
    """The static KV cache's blocks on each device (batch x max context)."""
    token_latency_s: float | None = None
    """One decode step: every sequence of the batch gets its next token."""
    tokens_per_s: float | None = None
    """Generated tokens per second over the batch (batch / token latency)."""
    prefill_time_s: float | None = None
    """The prefill of a prompt of the example's length, on the same layouts."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | Estimates | None) -> Estimates:
        """The record of a plan file's ``estimates`` (or of a dict built in code)."""
        if isinstance(d, Estimates):
            return d
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown plan estimate(s) {', '.join(map(repr, unknown))}; "
                             f"an Estimates record holds {', '.join(sorted(known))}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """The set fields, as the plan's JSON holds them."""
        return {name: value for name in _FIELD_NAMES
                if (value := getattr(self, name)) is not None}

    def __repr__(self) -> str:
        return f"Estimates({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"


_FIELD_NAMES = tuple(f.name for f in fields(Estimates))


@dataclass(frozen=True)
class LayoutCost:
    """What one layout of a parameter costs per step, every other decision unchanged."""

    placements: tuple[str, ...]      # per mesh axis, e.g. ("Replicate()", "Shard(0)")
    communication_s: float           # its readers' and its gradient's resharding
    state_bytes: float               # parameter, gradient and optimizer states per device

    def to_dict(self) -> dict:
        return {"placements": list(self.placements), "communication_s": self.communication_s,
                "state_bytes": self.state_bytes}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayoutCost:
        return cls(placements=tuple(d["placements"]), communication_s=d["communication_s"],
                   state_bytes=d["state_bytes"])


@dataclass(frozen=True)
class Explanation:
    """Why a parameter has its layout: its cost, and the best other layout's."""

    chosen: LayoutCost
    runner_up: LayoutCost | None = None

    def to_dict(self) -> dict:
        d = self.chosen.to_dict()
        if self.runner_up is not None:
            d["runner_up"] = self.runner_up.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Explanation:
        if isinstance(d, Explanation):
            return d
        other = d.get("runner_up")
        return cls(chosen=LayoutCost.from_dict(d),
                   runner_up=None if other is None else LayoutCost.from_dict(other))


def explanations_from_dict(d: Mapping[str, Any] | None) -> dict[str, Explanation]:
    """Per parameter name, its ``Explanation`` (from a plan file or a dict built in code)."""
    return {name: Explanation.from_dict(e) for name, e in (d or {}).items()}


def explanations_to_dict(explanations: Mapping[str, Explanation]) -> dict[str, dict]:
    return {name: e.to_dict() for name, e in explanations.items()}
