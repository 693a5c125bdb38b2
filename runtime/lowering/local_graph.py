"""A slice of the source graph as this rank's local joint graph: the per-node lowering.

``lower_slice`` interprets the ops of a ``GraphSlice`` one by one (``lower_node``, the
per-node hook): every op runs on local blocks, with shape arguments localized
(``runtime.lowering.localize``), and every resharding step the plan lists becomes a call in
``runtime.execution.collectives`` right before the op that needs it (``StepEmitter``). Two kinds of op
run all-reduces inside themselves: an op splitting a synced dim (a softmax over a split
vocabulary, ``runtime.lowering.synced``) becomes its local phases with the all-reduces of its
statistics between them, and an op the plan batch-synchronizes (batch norm over a split
batch, ``runtime.lowering.sync_norm``) sums its statistics before its local pass.

The result is one graph holding forward and backward (``LocalGraph``); ``runtime.lowering.lower``
rewrites it and splits it into the programs a step runs.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

import torchalpa.ops.attention  # noqa: F401  (registers torchalpa::sdpa, which programs call)
import torchalpa.ops.cross_entropy  # noqa: F401  (registers torchalpa::cross_entropy, likewise)
from torchalpa.core.opgraph import ValueRef
from torchalpa.core.plan import OutputSlot, Plan, ReshardStep
from torchalpa.runtime.execution import collectives as C
from torchalpa.runtime.lowering import sync_norm
from torchalpa.runtime.lowering.localize import localize
from torchalpa.runtime.lowering.rank_programs import PLAN_STEP, ValueKey
from torchalpa.runtime.lowering.synced import block_args, run_synced, synced_axes

__all__ = ["GraphSlice", "LocalGraph", "StepEmitter", "lower_slice", "lower_node", "producers",
           "received_name"]


@dataclass(frozen=True)
class GraphSlice:
    """The part of the source graph one rank's programs compute, and their wiring.

    ``placeholders``: source placeholders forward takes, in order. ``nodes``: the source
    ops computed, in graph order. ``received``: values another stage sends, each with its
    phase, taken as placeholders (forward ones after ``placeholders``, backward ones after
    the saved values). ``summed``: gradient parts another stage sends once per step; the
    add that joins them into a gradient is emitted without them (see ``summed_recvs``).
    ``grads`` / ``updates``: (FQN, source value) of each trainable parameter's gradient
    (None: unused) and each buffer's new value. ``sends``: values this slice sends, with
    their phase; ``summed_sends``: those the receiver only adds into a gradient, sent as
    backward leaves them (the sender sums them over the micro-batches and makes the sum
    whole once per step: ``StageProgram.summed_sends``).
    """

    placeholders: tuple[fx.Node, ...]
    nodes: tuple[fx.Node, ...]
    loss: fx.Node | None
    grads: tuple[tuple[str, fx.Node | None], ...]
    updates: tuple[tuple[str, fx.Node], ...]
    received: tuple[tuple[ValueKey, str], ...] = ()
    summed: frozenset[ValueKey] = frozenset()
    sends: tuple[tuple[ValueKey, str], ...] = ()
    summed_sends: frozenset[ValueKey] = frozenset()


@dataclass
class LocalGraph:
    """A slice lowered into one local graph: forward and backward together, no output node.

    ``forward_phs`` / ``backward_phs``: the placeholders forward and backward take (inputs
    and forward receives; backward receives). ``loss``, ``forward_sends``, ``updates``: what
    forward returns; ``raw_grads`` (one per parameter of the slice, None: unused) and
    ``backward_sends``: what backward returns. ``summed_into``: each add whose other operand
    another stage sends summed once per step -> (that value's key, its operand slot).
    ``source_of``: local node -> the source node whose value it is, for the values read
    as computed (a source op's lowered result, a placeholder after its input steps);
    ``meta["val"]`` there gives the global rank and dtype."""

    graph: fx.Graph
    forward_phs: list[fx.Node]
    backward_phs: list[fx.Node]
    loss: fx.Node | None = None
    forward_sends: list[fx.Node] = field(default_factory=list)
    updates: list[fx.Node] = field(default_factory=list)
    raw_grads: list[fx.Node | None] = field(default_factory=list)
    backward_sends: list[fx.Node] = field(default_factory=list)
    summed_into: dict[str, tuple[ValueKey, int]] = field(default_factory=dict)
    source_of: dict[fx.Node, fx.Node] = field(default_factory=dict)

    @property
    def forward_out(self) -> list[fx.Node]:
        """What forward returns before the values it saves: loss, sends, buffer updates."""
        return ([] if self.loss is None else [self.loss]) + self.forward_sends + self.updates

    @property
    def backward_out(self) -> list[fx.Node | None]:
        return self.raw_grads + self.backward_sends

    def held(self) -> frozenset[fx.Node]:
        """The nodes the programs' outputs hold by reference: rewrites leave them in place."""
        return frozenset(n for n in self.forward_out + self.backward_out
                         if isinstance(n, fx.Node))


def received_name(key: ValueKey) -> str:
    """The placeholder name (and reshard consumer) of a value received from another stage."""
    return f"recv_{key[0]}_{key[1]}"


def producers(gm: fx.GraphModule) -> dict[str, ValueKey]:
    """Source node name -> the (producer, index) value it is: a getitem names its
    multi-output producer's item, anything else its own output 0."""
    producer_of: dict[str, ValueKey] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            producer_of[n.name] = (producer_of[n.args[0].name][0], n.args[1])
        elif n.op != "output":
            producer_of[n.name] = (n.name, 0)
    return producer_of


class StepEmitter:
    """Appends the calls of plan steps (``runtime.execution.collectives.step_call``) to a graph."""

    def __init__(self, graph: fx.Graph, mesh_shape, coords, group_names):
        self.graph, self.mesh_shape = graph, tuple(mesh_shape)
        self.coords, self.group_names = tuple(coords), tuple(group_names)

    def steps(self, value: fx.Node, steps: Sequence[ReshardStep], reshard=None) -> fx.Node:
        """``steps`` applied to ``value``; with ``reshard`` (the plan's (consumer, slot)
        key of these steps), each call is tagged ``meta[PLAN_STEP] = (consumer, slot, i)``
        so a later pass can name the plan collective a call runs
        (``runtime.rewrites.loss_in_bucket``, ``runtime.rewrites.param_gather``)."""
        for i, step in enumerate(steps):
            fn, args = C.step_call(step, self.mesh_shape, self.coords, self.group_names)
            value = self.graph.call_function(fn, (value, *args))
            if reshard is not None:
                value.meta[PLAN_STEP] = (*reshard, i)
        return value


def lower_slice(gm: fx.GraphModule, part: GraphSlice, plan: Plan, *, coords, group_names,
                device: torch.device) -> LocalGraph:
    """``part`` of the source graph ``gm`` under ``plan`` (the slice's intra-op plan) as
    the local joint graph of the rank at mesh coordinate ``coords``."""
    return _SliceLowering(gm, part, plan, coords, group_names, device).run()


class _SliceLowering:
    """The state of one ``lower_slice``: the plan's tables, and the local value of every
    source value lowered so far."""

    def __init__(self, gm: fx.GraphModule, part: GraphSlice, plan: Plan, coords, group_names,
                 device: torch.device):
        self.gm, self.part, self.plan, self.device = gm, part, plan, device
        self.strategies = {s.node: s for s in plan.strategies}
        self.reshards = {(r.consumer, r.slot): r.steps for r in plan.reshards}
        self.same_as = {(r.consumer, r.slot): r.same_as for r in plan.reshards if r.same_as}
        self.producer_of = producers(gm)
        self.graph = fx.Graph()
        self.emit = StepEmitter(self.graph, plan.mesh_shape, coords, group_names)
        self.env: dict[str, fx.Node] = {}
        self.received: dict[ValueKey, fx.Node] = {}
        self.copies: dict[tuple[str, int], fx.Node] = {}   # operand read -> its resharded value

    def run(self) -> LocalGraph:
        local = LocalGraph(self.graph, [], [])
        self._placeholders(local)
        for n in self.part.nodes:
            self._node(n, local)
        self._outputs(local)
        return local

    def _input_steps(self, name: str) -> tuple[ReshardStep, ...]:
        return self.reshards.get((name, "input"), ())

    def _placeholders(self, local: LocalGraph) -> None:
        for ph in self.part.placeholders:
            value = self.graph.placeholder(ph.name)
            local.forward_phs.append(value)
            self.env[ph.name] = self.emit.steps(value, self._input_steps(ph.name))
            local.source_of[self.env[ph.name]] = ph
        for key, phase in self.part.received:
            value = self.graph.placeholder(received_name(key))
            (local.forward_phs if phase == "forward" else local.backward_phs).append(value)
            self.received[key] = self.emit.steps(value, self._input_steps(received_name(key)))

    def lookup(self, a: fx.Node) -> fx.Node:
        if a.name in self.env:
            return self.env[a.name]
        key = self.producer_of[a.name]
        if key in self.received:
            return self.received[key]
        raise AssertionError(f"the slice reads {a.name}, which it neither makes nor receives")

    def read_operand(self, value: fx.Node, consumer: str, slot: int) -> fx.Node:
        """``value`` as ``consumer`` reads it in operand ``slot``: resharded by the plan's
        steps, or the copy an earlier read made (``Reshard.same_as``)."""
        source = self.same_as.get((consumer, slot))
        if source is not None:
            return self.copies[source]
        self.copies[(consumer, slot)] = self.emit.steps(
            value, self.reshards.get((consumer, slot), ()), (consumer, slot))
        return self.copies[(consumer, slot)]

    def _node(self, n: fx.Node, local: LocalGraph) -> None:
        summed = [] if n.target is operator.getitem else \
            [(i, self.producer_of[a.name]) for i, a in enumerate(n.args[:2])
             if isinstance(a, fx.Node) and self.producer_of[a.name] in self.part.summed]
        if summed:             # gradient = own part + received part: emit the own part only
            (slot, key), = summed
            other = n.args[1 - slot]
            assert isinstance(other, fx.Node)
            self.env[n.name] = self.read_operand(self.lookup(other), n.name, 1 - slot)
            local.summed_into[n.name] = (key, slot)
            return
        self.env[n.name] = lower_node(n, self.graph, self.lookup, self.read_operand,
                                      self.strategies.get(n.name), self.plan.mesh_shape,
                                      self.device, self.emit.coords, self.emit.group_names)
        local.source_of[self.env[n.name]] = n

    def _value_of(self, key: ValueKey) -> fx.Node:
        if key in self.received:
            return self.received[key]
        producer, index = key
        getter = next((n for n in self.gm.graph.nodes if n.op == "call_function" and
                       n.target is operator.getitem and n.args[0].name == producer
                       and n.args[1] == index), None)
        return self.env[getter.name] if getter is not None else self.env[producer]

    def _output_steps(self, slot: OutputSlot) -> tuple[ReshardStep, ...]:
        return self.reshards.get(slot.reshard_key(), ())

    def _outputs(self, local: LocalGraph) -> None:
        part, emit = self.part, self.emit
        if part.loss is not None:
            local.loss = emit.steps(self.lookup(part.loss), self._output_steps(OutputSlot.loss()),
                                    OutputSlot.loss().reshard_key())
        sends = {key: self._value_of(key) if key in part.summed_sends else
                 emit.steps(self._value_of(key),
                            self._output_steps(OutputSlot.send(str(ValueRef(*key)))),
                            OutputSlot.send(str(ValueRef(*key))).reshard_key())
                 for key, _ in part.sends}
        local.forward_sends = [sends[k] for k, phase in part.sends if phase == "forward"]
        local.backward_sends = [sends[k] for k, phase in part.sends if phase != "forward"]
        local.raw_grads = [None if g is None else self.lookup(g) for _, g in part.grads]
        local.updates = [emit.steps(self.lookup(u), self._output_steps(OutputSlot.buffer(fqn)))
                         for fqn, u in part.updates]


def lower_node(n: fx.Node, graph: fx.Graph, lookup, read_operand, strategy, mesh_shape,
               device: torch.device, coords, group_names) -> fx.Node:
    """The per-node hook: one source op as local ops, each tensor operand first brought
    to the layout the op's ``strategy`` reads (``read_operand``), shapes localized (an
    item of a multi-output op has no strategy of its own)."""
    if n.target is operator.getitem:
        return graph.call_function(operator.getitem, (lookup(n.args[0]), n.args[1]))
    assert strategy is not None, f"the plan has no strategy for {n.name}"
    slots = iter(range(1 << 30))

    def local_arg(a):
        if not isinstance(a, fx.Node):
            return a
        return read_operand(lookup(a), n.name, next(slots))

    args = tree_map(local_arg, list(n.args))
    kwargs = {k: tree_map(local_arg, v) for k, v in n.kwargs.items()}
    axes = synced_axes(n, args, strategy.inputs)
    if axes:   # a split softmax dim: local phases joined by all-reduces of statistics
        assert not kwargs, f"{n.name}: a synced op takes positional arguments only"
        return run_synced(
            str(n.target), block_args(n, args, strategy.inputs, mesh_shape, coords), axes,
            lambda stat, op, axis: graph.call_function(
                C.all_reduce, (stat, op, group_names[axis])),
            call=lambda fn, a: graph.call_function(fn, a))
    target, args, kwargs = localize(n, args, kwargs, strategy, mesh_shape, device, coords)
    if strategy.batch_syncs:    # batch norm over a split batch: sums all-reduced inside
        op = str(n.target)
        position = sync_norm.SYNCED[op].names.index("input")
        source = n.args[position] if position < len(n.args) else n.kwargs["input"]
        assert isinstance(source, fx.Node)
        target, args, kwargs = sync_norm.synced_call(
            op, args, kwargs, input_shape=tuple(source.meta["val"].shape),
            groups=[group_names[axis] for axis, _ in strategy.batch_syncs])
    return graph.call_function(target, tuple(args), kwargs)
