"""Gather the parameters once per step, not once per micro-batch, in buckets.

With gradient accumulation (``num_micro_batches=k``) the forward program runs ``k`` times
a step. A plan that keeps parameters sharded between steps (ZeRO-2: ``Zero2Parallel``)
gathers each one where forward reads it, so a step would gather every parameter ``k``
times, although the parameters do not change within a step (the optimizer steps after the
last micro-batch). Alpa gathers the updated parameters once, merged into one all-gather.
So does this module, for one-stage steps (``runtime.lowering.lower.lower``):

- ``gathered_once(plan, k)``: the reshards of a parameter (or buffer) that a forward op
  reads in another layout, and whose steps include a collective, when
  ``plan.state_read_once`` holds (``k > 1``, and the method does not gather parameters
  again in backward to hold less: ZeRO-3's gathers stay per micro-batch);
- ``gather_buckets(plan, k)``: those that are one plain all-gather, packed by mesh axis
  and element size, in the plan's order, into buckets of at most the gradient buckets'
  threshold (``buckets.bucket_threshold``): one all-gather each;
- ``hoist_parameter_gathers``: moves those reshards out of the forward program into a
  program of their own, ``(*params, *buffers) -> gathered copies``, which the step runs
  before its first micro-batch (``runtime.execution.step``); the forward takes the copies as its
  last inputs. ``gather_parameters_once`` is the pass the lowering applies
  (``runtime.rewrites.program_rewrites``): it finds those reshards' calls in the forward program by the
  plan step each is tagged with, and hoists them.

Memory: a gathered copy lives for the step. Each micro-batch's forward that would have
gathered its own copy and saved it for backward now saves the same one, so while several
micro-batches wait for backward one copy is held instead of one each; but a copy that
forward read and then dropped (a bias, whose gradient does not need it) is held until the
micro-batches' forwards are done. The runner drops its own reference after the last
forward; what backward still reads is held by the micro-batches' saved values. The cost
model prices these reads once per step (``passes/sharding/costgraph.py``) and its memory estimate
holds a parameter's gathered view from the start of the step (``passes/pricing/memory.py``).

``issued_collectives`` (``runtime.rewrites.buckets``) lists the same: each hoisted reshard once,
each bucket as one all-gather.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.fx as fx

from torchalpa.core.placement import local_shape, split_factor_of
from torchalpa.core.plan import OUTPUT, OutputSlot, Plan, state_read_once
from torchalpa.runtime.execution import collectives as C
from torchalpa.runtime.lowering.rank_programs import PLAN_STEP
from torchalpa.runtime.rewrites.buckets import bucket_threshold, flatten_concat

__all__ = ["GatherBucket", "gathered_once", "gather_buckets", "split_gathered",
           "hoist_parameter_gathers", "gather_parameters_once", "ReaderKey"]

ReaderKey = tuple[str, "int | OutputSlot"]
"""(consumer, operand slot) of a plan reshard: the read it lays a value out for (or
(``OUTPUT``, the send slot) of a tied weight another stage reads)."""


@dataclass(frozen=True, slots=True)
class GatherBucket:
    """Parameters' all-gathers over one mesh axis issued as one, in packing order."""

    axis: int
    readers: tuple[ReaderKey, ...]   # the members' reshards
    positions: tuple[int, ...]       # their collectives in ``plan.collectives``
    bytes: int                       # what this rank contributes (sum of the members)
    itemsize: int


def _rematerializes(plan: Plan) -> bool:
    option = (plan.method or {}).get("auto_sharding_option") or {}
    return bool(option.get("rematerialize_parameters", False))


def gathered_once(plan: Plan, num_micro_batches: int) -> dict[ReaderKey, tuple[int, ...]]:
    """The reshards a step runs once, before its first micro-batch: each reader's key ->
    the positions of its collectives in ``plan.collectives``. Empty unless
    ``plan.state_read_once``."""
    if not state_read_once(num_micro_batches, _rematerializes(plan)):
        return {}
    state = {p.node for p in plan.parameters}
    out: dict[ReaderKey, tuple[int, ...]] = {}
    position = -1
    for r in plan.reshards:
        positions = []
        for s in r.steps:
            if s.is_collective:
                position += 1
                positions.append(position)
        if r.producer in state and r.consumer != OUTPUT and isinstance(r.slot, int) \
                and positions and all(plan.collectives[i].phase == "forward" for i in positions):
            out[(r.consumer, r.slot)] = tuple(positions)
        elif r.producer in state and r.consumer == OUTPUT and isinstance(r.slot, OutputSlot) \
                and r.slot.kind == "send" and positions:
            # a tied weight another stage reads: sent once per step, gathered once too
            out[(r.consumer, r.slot)] = tuple(positions)
    return out


def gather_buckets(plan: Plan, num_micro_batches: int, threshold: int | None = None
                   ) -> tuple[GatherBucket, ...]:
    """The hoisted reshards that are one plain all-gather, packed into buckets of at most
    ``threshold`` contributed bytes (default ``bucket_threshold(plan)``; 0: none), by axis
    and element size, in plan order; a bucket holds two or more."""
    threshold = bucket_threshold(plan) if threshold is None else threshold
    once = gathered_once(plan, num_micro_batches)
    shapes = {p.node: p.shape for p in plan.parameters}
    open_buckets: dict[tuple[int, int], list] = {}
    closed: list[tuple[int, list]] = []       # (itemsize, members)
    for r in plan.reshards:
        if not isinstance(r.slot, int) or (r.consumer, r.slot) not in once or len(r.steps) != 1:
            continue
        key = (r.consumer, r.slot)
        step = r.steps[0]
        if step.kind != "all_gather" or split_factor_of(step.src[step.axis]) > 1:
            continue
        numel = math.prod(local_shape(shapes[r.producer], step.src, plan.mesh_shape))
        if numel == 0 or step.bytes % numel:
            continue
        group = (step.axis, step.bytes // numel)
        members = open_buckets.get(group)
        if members is None or sum(s.bytes for _, s, _ in members) + step.bytes > threshold:
            members = open_buckets[group] = []
            closed.append((group[1], members))
        members.append((key, step, once[key][0]))
    return tuple(GatherBucket(axis=m[0][1].axis, readers=tuple(k for k, _, _ in m),
                              positions=tuple(i for _, _, i in m),
                              bytes=sum(s.bytes for _, s, _ in m), itemsize=itemsize)
                 for itemsize, m in closed if len(m) > 1)


def split_gathered(flat: torch.Tensor, like: Sequence[torch.Tensor], dims: Sequence[int],
                   group_size: int) -> list[torch.Tensor]:
    """Each tensor gathered from an all-gather of the ranks' ``flatten_concat(like)``: rank
    ``r``'s block of tensor ``i`` is its part of row ``r``, and the blocks are joined along
    ``dims[i]`` in rank order (as ``collectives.all_gather`` joins them). Contiguous."""
    rows = flat.view(group_size, -1)
    out, offset = [], 0
    for t, dim in zip(like, dims):
        blocks = rows[:, offset:offset + t.numel()].reshape(group_size, *t.shape)
        out.append(blocks.movedim(0, dim).flatten(dim, dim + 1).contiguous())
        offset += t.numel()
    return out


def hoist_parameter_gathers(forward: fx.GraphModule, chains: dict[ReaderKey, list[fx.Node]],
                            buckets: Sequence[GatherBucket], *, num_state: int,
                            group_sizes: Sequence[int]) -> fx.GraphModule | None:
    """Move the calls of ``chains`` (each hoisted reshard's calls in ``forward``, in order,
    the first reading a state placeholder) into a new program ``(*state) -> copies``,
    returned; ``forward`` (changed in place) takes those copies after its own inputs. The
    first all-gathers of a bucket's members become one. None (``forward`` untouched): no
    chains."""
    if not chains:
        return None
    graph = forward.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    state = placeholders[:num_state]
    hoisted = {n for calls in chains.values() for n in calls}
    for n in hoisted:
        assert all(a in hoisted or a in state for a in n.all_input_nodes), \
            f"{n.name} reads a value the step computes: not a parameter's resharding"
    gathers = fx.Graph()
    env: dict[fx.Node, fx.Node] = {ph: gathers.placeholder(ph.name) for ph in state}
    for bucket in buckets:
        if not all(k in chains for k in bucket.readers):
            continue
        calls = [chains[k][0] for k in bucket.readers]
        assert all(c.target is C.all_gather for c in calls), [c.target for c in calls]
        group = calls[0].args[3]
        assert all(c.args[3] == group for c in calls), "a bucket spans process groups"
        members = [env[cast(fx.Node, c.args[0])] for c in calls]
        flat = gathers.call_function(flatten_concat, (members,))
        n = group_sizes[bucket.axis]
        gathered = gathers.call_function(C.all_gather, (flat, 0, n, group))
        parts = gathers.call_function(split_gathered, (gathered, members,
                                                       [c.args[1] for c in calls], n))
        for i, c in enumerate(calls):
            env[c] = gathers.call_function(operator.getitem, (parts, i))
    for n in graph.nodes:
        if n in hoisted and n not in env:
            env[n] = gathers.node_copy(n, lambda x: env[x])
    tails = [n for n in graph.nodes if n in hoisted and any(u not in hoisted for u in n.users)]
    gathers.output(tuple(env[t] for t in tails))
    gathers.lint()
    anchor = placeholders[-1]
    for i, t in enumerate(tails):
        with graph.inserting_after(anchor):
            anchor = graph.placeholder(f"gathered_{i}_{t.name}")
        t.replace_all_uses_with(anchor, delete_user_cb=lambda u: u not in hoisted)
    for n in reversed([n for n in graph.nodes if n in hoisted]):
        graph.erase_node(n)
    graph.lint()
    forward.recompile()
    return fx.GraphModule(forward, gathers, "ParameterGathers")


def gather_parameters_once(forward: fx.GraphModule, plan: Plan, num_micro_batches: int, *,
                           num_state: int, bucketed: bool = True) -> fx.GraphModule | None:
    """The pass: the reads ``gathered_once(plan, num_micro_batches)`` names, found in
    ``forward`` by the plan step each call is tagged with (``programs.PLAN_STEP``), hoisted
    into a program run once per step (``hoist_parameter_gathers``; in buckets unless
    ``bucketed`` is False), returned. ``num_state``: how many of forward's placeholders
    are parameters and buffers (they come first). None: nothing to hoist."""
    hoisted = gathered_once(plan, num_micro_batches)
    chains: dict[ReaderKey, list[fx.Node]] = {}
    for n in forward.graph.nodes:
        key = tuple(n.meta.get(PLAN_STEP, ())[:2])
        if key in hoisted:
            chains.setdefault(cast(ReaderKey, key), []).append(n)
    assert set(chains) == set(hoisted), \
        f"parameter reads the plan lists in forward but not lowered there: {set(hoisted) - set(chains)}"
    return hoist_parameter_gathers(
        forward, chains, gather_buckets(plan, num_micro_batches) if bucketed else (),
        num_state=num_state, group_sizes=plan.mesh_shape)
