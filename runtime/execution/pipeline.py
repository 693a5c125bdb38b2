"""Run a PipelinePlan: each rank runs its stage's programs on micro-batches.

Lowering a stage takes the nodes of the source graph the plan gives this stage, with
values made by other stages as placeholders it receives, and splits them into

- ``forward(params, buffers, user inputs, received activations)`` -> the loss (last
  stage), activations to send, buffer updates, and what backward needs;
- ``backward(saved, received gradients)`` -> raw gradients of this stage's parameters
  (None: unused) and gradients to send to earlier stages;
- ``reduce_grads(raw gradients)`` -> gradients in their parameters' layouts, once per
  step after summing the micro-batches (every resharding step is linear).

With several micro-batches a stage gathers its parameters once per step, before its first
micro-batch, as a one-stage step does (ZeRO-1/2 inside a stage gather the updated
parameters once, not once per micro-batch).

Values cross stages point to point: the sender holds them whole (its plan gathers them),
receiving rank j of a stage takes them from rank ``j mod n`` of the sending stage, and
slices what it needs (``StageExchange``). A value crossing batch-split
(``Transfer.batch_split``: both stages on the same logical mesh) is not gathered: each
sending rank holds its block of the batch (its plan lays the send out so), sends it to
the rank at its own position of the receiving stage, whose plan reads it as that block.
A transfer the plan splits (``Transfer.split``, Megatron's scatter-gather) sends each
receiving rank only its chunk of the flattened value (of its block, batch-split), the
one at its coordinate on its stage mesh's last axis, and the receivers all-gather the
chunks over that axis. A schedule (GPipe, 1F1B) orders the forward and
backward work of the micro-batches (``runtime.execution.step.StepRunner``, the runner of every
step); sends are non-blocking, so a valid schedule cannot deadlock.

The lowering itself is ``runtime.lowering.lower``'s, shared with intra-op plans: this module only
says which slice of the graph a stage computes and how it is wired to the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.fx as fx

from torchalpa.core.plan import PipelinePlan
from torchalpa.runtime.lowering.local_graph import GraphSlice, producers
from torchalpa.runtime.lowering.lower import build_programs
from torchalpa.runtime.lowering.rank_programs import StageProgram
from torchalpa.runtime.measurement.traffic import point_to_point, wait_label

__all__ = ["StageProgram", "lower_stage", "stage_slice", "StageExchange", "transfer_specs"]


def lower_stage(gm: fx.GraphModule, pplan: PipelinePlan, stage: int, *, param_names: list[str],
                buffer_names: list[str], buffer_updates: list[str], coords, group_names,
                device: torch.device) -> StageProgram:
    """This rank's programs for ``stage`` of ``pplan`` (``coords`` in the stage mesh): the
    stage's slice of the graph through the one lowering (``runtime.lowering.lower``). With
    several micro-batches the stage's parameters are gathered once per step, before its
    first micro-batch (``runtime.rewrites.param_gather``), as its plan prices them."""
    part, wiring = stage_slice(gm, pplan, stage, param_names=param_names,
                               buffer_names=buffer_names, buffer_updates=buffer_updates)
    num_state = len(wiring["params"]) + len(wiring["buffers"])  # the slice's first leaves
    built = build_programs(gm, part, pplan.stages[stage].plan, coords=coords,
                           group_names=group_names, device=device,
                           gathers_once=(pplan.num_micro_batches, num_state))
    return replace(built, **wiring)


def stage_slice(gm: fx.GraphModule, pplan: PipelinePlan, stage: int, *,
                param_names: Sequence[str], buffer_names: Sequence[str],
                buffer_updates: Sequence[str]) -> tuple[GraphSlice, dict]:
    """The part of the source graph ``stage`` computes, and the stage's wiring (the
    ``StageProgram`` fields naming its parameters, buffers, inputs, receives and sends)."""
    node_stage = pplan.node_stage
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    P, Bf = len(param_names), len(buffer_names)
    kinds = {ph.name: ("param", param_names[i]) if i < P else
             ("buffer", buffer_names[i - P]) if i < P + Bf else ("input", i - P - Bf)
             for i, ph in enumerate(placeholders)}
    producer_of = producers(gm)
    included = [n for n in nodes if n.op == "call_function"
                and node_stage.get(producer_of[n.name][0]) == stage]
    transfers_in = {(t.producer, t.index): t.phase for t in pplan.transfers if t.dst_stage == stage}
    summed_in = {(t.producer, t.index) for t in pplan.transfers
                 if t.dst_stage == stage and t.once_per_step and t.phase != "forward"}
    sends_out: dict[tuple[str, int], str] = {}
    for t in pplan.transfers:
        if t.src_stage == stage:
            sends_out.setdefault((t.producer, t.index), t.phase)

    def owned(kind: str) -> list[tuple[fx.Node, str]]:
        return [(ph, str(kinds[ph.name][1])) for ph in placeholders
                if kinds[ph.name][0] == kind and node_stage.get(ph.name) == stage]

    owned_params, owned_buffers = owned("param"), owned("buffer")
    outs = nodes[-1].args[0]
    grads = dict(zip(param_names, outs[1:1 + P]))
    updates = dict(zip(buffer_updates, outs[1 + P:]))
    # the user inputs this stage reads
    reads = {a.name for n in included for a in n.all_input_nodes}
    reads |= {g.name for _, fqn in owned_params if (g := grads.get(fqn)) is not None}
    reads |= {u.name for _, fqn in owned_buffers if (u := updates.get(fqn)) is not None}
    user_inputs = [ph for ph in placeholders if kinds[ph.name][0] == "input" and ph.name in reads]
    part = GraphSlice(
        placeholders=tuple(ph for ph, _ in owned_params + owned_buffers) + tuple(user_inputs),
        nodes=tuple(included),
        loss=outs[0] if node_stage.get(producer_of[outs[0].name][0]) == stage else None,
        grads=tuple((fqn, grads.get(fqn)) for _, fqn in owned_params),
        updates=tuple((fqn, updates[fqn]) for _, fqn in owned_buffers if fqn in updates),
        received=tuple((k, phase) for k, phase in transfers_in.items() if k not in summed_in),
        summed=frozenset(summed_in), sends=tuple(sends_out.items()),
        summed_sends=frozenset(k for k in sends_out if k in _summed_keys(pplan, stage)))
    wiring = dict(
        params=[fqn for _, fqn in owned_params], buffers=[fqn for _, fqn in owned_buffers],
        user_inputs=[kinds[ph.name][1] for ph in user_inputs],
        forward_recvs=[k for k, phase in transfers_in.items() if phase == "forward"],
        backward_recvs=[k for k, phase in transfers_in.items()
                        if phase != "forward" and k not in summed_in],
        forward_sends=[k for k, phase in sends_out.items() if phase == "forward"],
        backward_sends=[k for k, phase in sends_out.items() if phase != "forward"])
    return part, wiring


def _summed_keys(pplan: PipelinePlan, stage: int) -> set:
    """The values ``stage`` sends once per step, summed over the micro-batches: gradient
    parts the receiver only adds into a parameter's gradient."""
    return {(t.producer, t.index) for t in pplan.transfers
            if t.src_stage == stage and t.once_per_step and t.phase != "forward"}


_BACKWARD_SENDS_PENDING = 2
"""Backward sends a stage leaves pending per earlier stage before waiting for the oldest
(``StageExchange._release``)."""


class StageExchange:
    """How one rank's stage trades values with the other stages during a step
    (``runtime.execution.step.StepRunner`` calls it around the stage's programs)."""

    def __init__(self, pplan: PipelinePlan, stage: int, rank: int,
                 specs: dict[tuple[str, int], tuple[tuple[int, ...], torch.dtype]],
                 device: torch.device, gather_group=None):
        """``gather_group``: the process group of this rank's stage mesh's last axis, over
        which split transfers it receives are all-gathered (None: it receives none)."""
        self.pplan, self.stage, self.rank = pplan, stage, rank
        self.device = device
        self.specs = specs
        self.gather_group = gather_group
        mine = pplan.stages[stage].ranks
        self.position = mine.index(rank)
        # (key, peer stage) -> transfer number, shared by both ends
        self.tag_of = {(t.producer, t.index, t.src_stage, t.dst_stage): i
                       for i, t in enumerate(pplan.transfers)}
        # parameters another stage reads: sent with the first micro-batch of a step only;
        # gradient parts another stage only adds up: summed here, sent after the last
        self.once = {(t.producer, t.index) for t in pplan.transfers
                     if t.once_per_step and t.phase == "forward"}
        self.summed = _summed_keys(pplan, stage)
        self.begin()

    def begin(self) -> None:
        """A new step: nothing received, sent or summed yet."""
        self._step_values: dict = {}
        self._step_sent: set = set()
        self._sums: dict = {}
        self._pending: list = []

    def _peers_to(self, dst_stage: int) -> list[tuple[int, int]]:
        """(rank, coordinate on its stage mesh's last axis) of each receiver this rank
        sends to."""
        mine = self.pplan.stages[self.stage].ranks
        theirs = self.pplan.stages[dst_stage].ranks
        last = self.pplan.stages[dst_stage].plan.mesh_shape[-1]
        return [(r, j % last) for j, r in enumerate(theirs) if j % len(mine) == self.position]

    def _peer_from(self, src_stage: int) -> int:
        theirs = self.pplan.stages[src_stage].ranks
        return theirs[self.position % len(theirs)]

    def _tag(self, key, src, dst, micro):
        return self.tag_of[(key[0], key[1], src, dst)] * 100_003 + micro

    def send(self, key, value: torch.Tensor, micro: int) -> None:
        if key in self.summed and micro >= 0:
            self._sums[key] = value.clone() if key not in self._sums else self._sums[key] + value
            return
        micro = max(micro, 0)
        if key in self.once:
            if key in self._step_sent:
                return
            self._step_sent.add(key)
        value = value.contiguous()
        for t in self.pplan.transfers:
            if (t.producer, t.index) == key and t.src_stage == self.stage:
                if t.phase != "forward":
                    self._release(t.dst_stage, micro - _BACKWARD_SENDS_PENDING, "backward")
                chunks = value.reshape(-1).chunk(t.split) if t.split > 1 else None
                for peer, coordinate in self._peers_to(t.dst_stage):
                    sent = value if chunks is None else chunks[coordinate]
                    with point_to_point("send", sent, peer):
                        self._pending.append((t.dst_stage, micro, t.phase, dist.isend(
                            sent, peer, tag=self._tag(key, self.stage, t.dst_stage, micro))))

    def recv(self, key, micro: int) -> torch.Tensor:
        if key in self.once:
            if key not in self._step_values:
                self._step_values[key] = self._receive(key, micro)
            return self._step_values[key]
        return self._receive(key, micro)

    def _receive(self, key, micro: int) -> torch.Tensor:
        t = next(t for t in self.pplan.transfers
                 if (t.producer, t.index) == key and t.dst_stage == self.stage)
        shape, dtype = self.specs[key]
        whole = torch.empty(shape, dtype=dtype, device=self.device)
        buf = whole if t.split == 1 else whole.reshape(-1).chunk(t.split)[0].clone()
        peer = self._peer_from(t.src_stage)
        with point_to_point("recv", buf, peer):
            work = dist.irecv(buf, peer, tag=self._tag(key, t.src_stage, self.stage, micro))
            assert work is not None, "irecv in a process group returns its work"
            work.wait()
        if t.phase != "forward":
            self._release(t.src_stage, micro)
        if t.split == 1:
            return whole
        assert self.gather_group is not None, "a split transfer needs the gather group"
        parts = list(whole.reshape(-1).chunk(t.split))     # views: gathered in place
        dist.all_gather(parts, buf, group=self.gather_group)
        return whole

    def _release(self, stage: int, micro: int, phase: str = "forward") -> None:
        """Wait for the sends of ``phase`` to ``stage`` of micro-batches up to ``micro``, and
        drop them: a pending send holds its tensor (gloo's work keeps it) until waited for,
        so held to ``finish`` every micro-batch's sent activations and gradients stayed
        alive to the step's end (128 on BLOOM-176B's stages), where the memory model holds
        those of the micro-batches in flight. Forward sends go once a gradient of
        micro-batch ``micro`` came back from ``stage``: it ran that micro-batch's backward,
        so its forward had received them, and the wait does not block. Backward sends go
        ``_BACKWARD_SENDS_PENDING`` micro-batches later (nothing tells this stage the
        earlier stage received them): that stage needs nothing more from this one to reach
        their receive, so the wait cannot deadlock, and by then it has most likely passed
        it."""
        kept = []
        for entry in self._pending:
            dst, sent_micro, sent_phase, work = entry
            if dst == stage and (sent_phase == "forward") == (phase == "forward") \
                    and sent_micro <= micro:
                with wait_label("sends"):
                    work.wait()
            else:
                kept.append(entry)
        self._pending = kept

    def finish(self, program: StageProgram, raw: list, backward: bool) -> None:
        """End of the step's actions: after a backward, send the summed gradient parts
        (one message each) and add the received ones into ``raw``; wait for every send."""
        if backward:
            for k, total in self._sums.items():     # micro -1: the step's one message
                whole = program.summed_sends.get(k)    # made whole once, as it is sent
                self.send(k, total if whole is None else whole(total)[0], -1)
            for k, position, addend in program.summed_recvs:
                part = addend(self._receive(k, 0))[0]
                raw[position] = part if raw[position] is None else raw[position] + part
        with wait_label("sends"):
            for *_, work in self._pending:
                work.wait()
        self._pending = []


def transfer_specs(gm: fx.GraphModule, plan: PipelinePlan
                   ) -> dict[tuple[str, int], tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every value crossing stages as one rank receives it, from the
    source graph: its block of the batch where it crosses batch-split."""
    vals = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    specs = {}
    for t in plan.transfers:
        val = vals[t.producer]
        if isinstance(val, (list, tuple)):
            val = val[t.index]
        shape = tuple(val.shape)
        if t.batch_split > 1:
            shape = (shape[0] // t.batch_split, *shape[1:])
        specs[(t.producer, t.index)] = (shape, val.dtype)
    return specs
