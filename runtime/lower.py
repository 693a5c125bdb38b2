"""Lower a Plan over the source graph to this rank's local programs: ONE lowering.

The source graph is the captured joint step ``(params, buffers, inputs) -> (loss, *grads,
*buffer updates)`` on global shapes. Lowering rewrites part of it for one rank: every op
runs on local blocks, with shape arguments localized (``runtime.localize``), and every
resharding step the plan lists becomes a call in ``runtime.collectives`` right before the
op that needs it. Two kinds of op run all-reduces inside themselves: an op splitting a
synced dim (a softmax over a split vocabulary, ``runtime.synced``) becomes its local
phases with the all-reduces of its statistics between them, and an op the plan
batch-synchronizes (batch norm over a split batch, ``runtime.sync_norm``) sums its
statistics before its local pass. The result is split into three programs, so it can sit
behind ``loss.backward()`` or a pipeline schedule:

- ``forward``: the loss, values sent to later stages, buffer updates, and what backward
  needs;
- ``backward``: those values (and gradients received from later stages) -> each gradient
  as the last op left it (possibly a partial sum, or a layout other than its parameter's),
  and gradients sent to earlier stages;
- ``reduce_grads``: the plan's final resharding of each gradient into its parameter's layout.

Which part of the graph a rank lowers is a ``GraphSlice``: an intra-op plan is a
one-stage pipeline whose slice is the whole graph (``lower``); a pipeline stage's slice is
its nodes plus the values it receives (``runtime.pipeline.lower_stage``). One builder
(``build_programs``), one per-node hook, one emitter, one split and one reduce program
serve both.

Every resharding step is linear, so gradients of several micro-batches can be summed
locally and reduced once (``reduce_grads`` runs once per optimizer step, not per
micro-batch), which is how gradient accumulation saves communication.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

import torchalpa.ops.attention  # noqa: F401  (registers torchalpa::sdpa, which programs call)
from torchalpa.core.opgraph import ValueRef
from torchalpa.core.plan import OutputSlot, Plan, ReshardStep
from torchalpa.runtime import collectives as C
from torchalpa.runtime import sync_norm
from torchalpa.runtime.attention_saved import save_attention_statistics
from torchalpa.runtime.buckets import fuse_gradient_buckets, gradient_buckets
from torchalpa.runtime.localize import localize
from torchalpa.runtime.overlap import overlap_collectives, prefetch_parameter_gathers
from torchalpa.runtime.param_gather import gather_buckets, gathered_once, hoist_parameter_gathers
from torchalpa.runtime.peephole import fold_relu_backward, inline_batched_matmul
from torchalpa.runtime.synced import run_synced, synced_axes

__all__ = ["StageProgram", "GraphSlice", "ValueKey", "lower", "build_programs",
           "producers", "received_name", "PLAN_STEP"]

PLAN_STEP = "torchalpa_plan_step"
"""``node.meta`` key of a collective call: (consumer, slot, index) of its plan step."""

ValueKey = tuple[str, int]
"""Output ``index`` of source node ``producer``: a value that may cross stages."""


@dataclass
class StageProgram:
    """One rank's programs and how they are wired to the other stages of a pipeline (an
    intra-op plan's are a stage that receives and sends nothing).

    ``forward(*params, *buffers, *user inputs, *forward_recvs)`` -> (loss if ``has_loss``,
    *forward sends, *buffer updates, *saved); ``backward(*saved, *backward_recvs)`` -> (one
    raw gradient per parameter of ``params`` or None, *backward sends); ``reduce_grads(*raw
    gradients that are not None)`` -> those gradients in their parameters' layouts.
    """

    forward: fx.GraphModule
    backward: fx.GraphModule
    reduce_grads: fx.GraphModule
    buffer_updates: tuple = ()    # buffers whose new values forward returns, in order
    params: list[str] = field(default_factory=list)    # FQNs of this stage's trainable params
    buffers: list[str] = field(default_factory=list)   # FQNs of its buffers / frozen params
    user_inputs: list[int] = field(default_factory=list)   # the user inputs this stage reads
    forward_recvs: list[ValueKey] = field(default_factory=list)   # received before forward
    backward_recvs: list[ValueKey] = field(default_factory=list)  # received before backward
    forward_sends: list[ValueKey] = field(default_factory=list)
    backward_sends: list[ValueKey] = field(default_factory=list)
    has_loss: bool = False
    grad_present: list[bool] = field(default_factory=list)
    # gradient parts received once per step, summed over the micro-batches by their
    # sender: (key, index among the present gradients, program laying the sum out as
    # that gradient's addend)
    summed_recvs: list[tuple[ValueKey, int, fx.GraphModule]] = field(default_factory=list)
    # (*params, *buffers) -> the parameters' gathered copies forward takes after its other
    # inputs, run once per step before the first micro-batch (``runtime.param_gather``)
    param_gathers: fx.GraphModule | None = None
    compiled_from: StageProgram | None = field(default=None, repr=False)
    """The eager programs these were compiled from (``compiled``), else None."""

    def code(self) -> str:
        if self.compiled_from is not None:
            return "# compiled with torch.compile from:\n" + self.compiled_from.code()
        gathers = self.param_gathers
        once = "" if gathers is None else ("# param_gathers, once per step: (params, buffers) -> "
                                           "gathered copies\n" + gathers.code + "\n")
        return (once + "# forward: (params, buffers, inputs) -> (loss, saved...)\n" + self.forward.code
                + "\n# backward: (saved...) -> raw grads\n" + self.backward.code
                + "\n# reduce_grads: (raw grads...) -> grads in their parameters' layouts\n"
                + self.reduce_grads.code)

    def compiled(self, **options) -> StageProgram:
        """The same programs under ``torch.compile(**options)`` (compiled on first call),
        with the same wiring; ``code()`` prints the source programs. A stage's
        ``summed_recvs`` addends and ``param_gathers`` run once per step and stay eager."""
        return replace(self,
                       forward=torch.compile(self.forward, **options),  # pyright: ignore
                       backward=torch.compile(self.backward, **options),  # pyright: ignore
                       reduce_grads=torch.compile(self.reduce_grads, **options),  # pyright: ignore
                       compiled_from=self)


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
    their phase.
    """

    placeholders: tuple[fx.Node, ...]
    nodes: tuple[fx.Node, ...]
    loss: fx.Node | None
    grads: tuple[tuple[str, fx.Node | None], ...]
    updates: tuple[tuple[str, fx.Node], ...]
    received: tuple[tuple[ValueKey, str], ...] = ()
    summed: frozenset[ValueKey] = frozenset()
    sends: tuple[tuple[ValueKey, str], ...] = ()


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


def lower(gm: fx.GraphModule, plan: Plan, param_names: list[str], *, coords, group_names,
          device: torch.device, overlap: bool = True, buffer_updates: Sequence[str] = (),
          buffer_names: Sequence[str] = (), num_micro_batches: int = 1) -> StageProgram:
    """This rank's local program for the intra-op ``plan`` (``coords``: this rank's mesh
    coordinate): a one-stage pipeline whose stage is the whole graph, wired as a stage
    that receives and sends nothing (``buffer_names``: the placeholders after the
    parameters that are buffers or frozen parameters; the rest are user inputs).

    ``overlap``: wait for each collective only where its result is first used
    (``runtime.overlap``), so communication runs behind the computation that follows.
    ``num_micro_batches``: the step's; with more than one, the parameters' forward
    gathers run once per step, in buckets, as their own program (``runtime.param_gather``).
    """
    nodes = list(gm.graph.nodes)
    outs = nodes[-1].args[0]
    assert nodes[-1].op == "output", "an fx graph ends with its output node"
    P = len(param_names)
    whole = GraphSlice(
        placeholders=tuple(n for n in nodes if n.op == "placeholder"),
        nodes=tuple(n for n in nodes if n.op == "call_function"),
        loss=outs[0], grads=tuple(zip(param_names, outs[1:1 + P])),
        updates=tuple(zip(buffer_updates, outs[1 + P:])))
    built = build_programs(gm, whole, plan, coords=coords, group_names=group_names,
                           device=device, overlap=overlap,
                           gathers_once=(num_micro_batches, P + len(buffer_names)))
    num_inputs = len(whole.placeholders) - P - len(buffer_names)
    return replace(built, params=list(param_names), buffers=list(buffer_names),
                   user_inputs=list(range(num_inputs)))


class _Emitter:
    """Appends the calls of plan steps (``runtime.collectives.step_call``) to a graph."""

    def __init__(self, graph: fx.Graph, mesh_shape, coords, group_names):
        self.graph, self.mesh_shape = graph, tuple(mesh_shape)
        self.coords, self.group_names = tuple(coords), tuple(group_names)

    def steps(self, value: fx.Node, steps: Sequence[ReshardStep], reshard=None) -> fx.Node:
        """``steps`` applied to ``value``; with ``reshard`` (the plan's (consumer, slot)
        key of these steps), each call is tagged ``meta[PLAN_STEP] = (consumer, slot, i)``
        so a later pass can name the plan collective a call runs (``runtime.loss_ride``)."""
        for i, step in enumerate(steps):
            fn, args = C.step_call(step, self.mesh_shape, self.coords, self.group_names)
            value = self.graph.call_function(fn, (value, *args))
            if reshard is not None:
                value.meta[PLAN_STEP] = (*reshard, i)
        return value


def build_programs(gm: fx.GraphModule, part: GraphSlice, plan: Plan, *, coords, group_names,
                   device: torch.device, overlap: bool = True,
                   bucketed: bool = True, gathers_once: tuple[int, int] = (1, 0)
                   ) -> StageProgram:
    """Lower ``part`` of the source graph ``gm`` under ``plan`` (the slice's intra-op
    plan) for the rank at mesh coordinate ``coords``: interpret the slice node by node
    (``_lower_node``), then split the local graph into forward and backward programs.
    The caller adds the wiring the slice does not know (parameter and buffer names,
    inputs, receives and sends).

    ``bucketed``: gradients' final collectives go out in buckets (``runtime.buckets``).
    ``gathers_once``: (the step's micro-batches, how many placeholders are parameters and
    buffers): the reads ``param_gather.gathered_once`` names move to a program run once
    per step (a one-stage step's, whose state placeholders come first)."""
    strategies = {s.node: s for s in plan.strategies}
    reshards = {(r.consumer, r.slot): r.steps for r in plan.reshards}
    producer_of = producers(gm)
    graph = fx.Graph()
    emit = _Emitter(graph, plan.mesh_shape, coords, group_names)
    env: dict[str, fx.Node] = {}
    received: dict[ValueKey, fx.Node] = {}
    forward_phs: list[fx.Node] = []
    backward_phs: list[fx.Node] = []

    def input_steps(name: str) -> tuple[ReshardStep, ...]:
        return reshards.get((name, "input"), ())

    for ph in part.placeholders:
        value = graph.placeholder(ph.name)
        forward_phs.append(value)
        env[ph.name] = emit.steps(value, input_steps(ph.name))
    for key, phase in part.received:
        value = graph.placeholder(received_name(key))
        (forward_phs if phase == "forward" else backward_phs).append(value)
        received[key] = emit.steps(value, input_steps(received_name(key)))

    def lookup(a: fx.Node) -> fx.Node:
        if a.name in env:
            return env[a.name]
        key = producer_of[a.name]
        if key in received:
            return received[key]
        raise AssertionError(f"the slice reads {a.name}, which it neither makes nor receives")

    same_as = {(r.consumer, r.slot): r.same_as for r in plan.reshards if r.same_as}
    copies: dict[tuple[str, int], fx.Node] = {}    # operand read -> its resharded value

    def read_operand(value: fx.Node, consumer: str, slot: int) -> fx.Node:
        """``value`` as ``consumer`` reads it in operand ``slot``: resharded by the plan's
        steps, or the copy an earlier read made (``Reshard.same_as``)."""
        source = same_as.get((consumer, slot))
        if source is not None:
            return copies[source]
        copies[(consumer, slot)] = emit.steps(value, reshards.get((consumer, slot), ()),
                                              (consumer, slot))
        return copies[(consumer, slot)]

    summed_into: dict[str, tuple[ValueKey, int]] = {}   # add node -> (key, its operand slot)
    for n in part.nodes:
        summed = [] if n.target is operator.getitem else \
            [(i, producer_of[a.name]) for i, a in enumerate(n.args[:2])
             if isinstance(a, fx.Node) and producer_of[a.name] in part.summed]
        if summed:             # gradient = own part + received part: emit the own part only
            (slot, key), = summed
            other = n.args[1 - slot]
            assert isinstance(other, fx.Node)
            env[n.name] = read_operand(lookup(other), n.name, 1 - slot)
            summed_into[n.name] = (key, slot)
        else:
            env[n.name] = _lower_node(n, graph, lookup, read_operand, strategies,
                                      plan.mesh_shape, device, coords, emit.group_names)

    def value_of(key: ValueKey) -> fx.Node:
        if key in received:
            return received[key]
        producer, index = key
        getter = next((n for n in gm.graph.nodes if n.op == "call_function" and
                       n.target is operator.getitem and n.args[0].name == producer
                       and n.args[1] == index), None)
        return env[getter.name] if getter is not None else env[producer]

    def output_steps(slot: OutputSlot) -> tuple[ReshardStep, ...]:
        return reshards.get(slot.reshard_key(), ())

    loss_value = None if part.loss is None else \
        emit.steps(lookup(part.loss), output_steps(OutputSlot.loss()),
                   OutputSlot.loss().reshard_key())
    send_values = {key: emit.steps(value_of(key), output_steps(OutputSlot.send(str(ValueRef(*key)))))
                   for key, _ in part.sends}
    raw_grads = [None if g is None else lookup(g) for _, g in part.grads]
    update_values = [emit.steps(lookup(u), output_steps(OutputSlot.buffer(fqn)))
                     for fqn, u in part.updates]

    present = [(fqn, g) for fqn, g in part.grads if g is not None]
    summed_recvs = []
    for add_name, (key, slot) in summed_into.items():
        position = next(i for i, (_, g) in enumerate(present) if g.name == add_name)
        steps = (*input_steps(received_name(key)), *reshards.get((add_name, slot), ()))
        summed_recvs.append((key, position, _steps_program(
            [(received_name(key), steps)], plan.mesh_shape, coords, group_names,
            "SummedGradient")))

    forward_sends = [send_values[k] for k, phase in part.sends if phase == "forward"]
    backward_sends = [send_values[k] for k, phase in part.sends if phase != "forward"]
    roots = ([] if loss_value is None else [loss_value]) + forward_sends + update_values
    # the peephole passes replace nodes; those held below by reference (a pipeline stage's
    # sends, the gradients, the roots) stay as they are
    held = frozenset(n for n in roots + raw_grads + backward_sends if isinstance(n, fx.Node))
    save_attention_statistics(graph, device, keep=held)
    fold_relu_backward(graph, keep=held)
    inline_batched_matmul(graph, keep=held)
    forward, backward = _split(graph, forward_phs, backward_phs, forward_out=roots,
                               backward_out=raw_grads + backward_sends)
    num_micro_batches, num_state = gathers_once
    hoisted = gathered_once(plan, num_micro_batches)
    chains: dict = {}
    for n in forward.graph.nodes:
        key = tuple(n.meta.get(PLAN_STEP, ())[:2])
        if key in hoisted:
            chains.setdefault(key, []).append(n)
    assert set(chains) == set(hoisted), \
        f"parameter reads the plan lists in forward but not lowered there: {set(hoisted) - set(chains)}"
    param_gathers = hoist_parameter_gathers(
        forward, chains, gather_buckets(plan, num_micro_batches) if bucketed else (),
        num_state=num_state, group_sizes=plan.mesh_shape)
    reduce_grads = _steps_program(
        [(f"grad_{i}", output_steps(OutputSlot.grad(fqn))) for i, (fqn, _) in enumerate(present)],
        plan.mesh_shape, coords, group_names, "ReduceGrads")
    if bucketed:
        fuse_gradient_buckets(reduce_grads, gradient_buckets(plan), group_sizes=plan.mesh_shape,
                              grad_names=[fqn for fqn, _ in present])
    if overlap:
        for program in (forward, backward, reduce_grads, param_gathers):
            if program is not None:
                overlap_collectives(program)
        for program in (forward, backward):
            prefetch_parameter_gathers(program)
    return StageProgram(forward, backward, reduce_grads,
                        buffer_updates=tuple(fqn for fqn, _ in part.updates),
                        has_loss=part.loss is not None,
                        grad_present=[g is not None for _, g in part.grads],
                        summed_recvs=summed_recvs, param_gathers=param_gathers)


def _lower_node(n: fx.Node, graph: fx.Graph, lookup, read_operand, strategies, mesh_shape,
                device: torch.device, coords, group_names) -> fx.Node:
    """The per-node hook: one source op as local ops, each tensor operand first brought
    to the layout the op's strategy reads (``read_operand``), shapes localized."""
    if n.target is operator.getitem:
        return graph.call_function(operator.getitem, (lookup(n.args[0]), n.args[1]))
    slots = iter(range(1 << 30))

    def local_arg(a):
        if not isinstance(a, fx.Node):
            return a
        return read_operand(lookup(a), n.name, next(slots))

    args = tree_map(local_arg, list(n.args))
    kwargs = {k: tree_map(local_arg, v) for k, v in n.kwargs.items()}
    strategy = strategies[n.name]
    axes = synced_axes(n, args, strategy.inputs)
    if axes:   # a split softmax dim: local phases joined by all-reduces of statistics
        assert not kwargs, f"{n.name}: a synced op takes positional arguments only"
        return run_synced(
            str(n.target), tuple(args), axes,
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


def _ancestors(value: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [value]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _split(graph: fx.Graph, forward_phs: list[fx.Node], backward_phs: list[fx.Node],
           forward_out: list[fx.Node], backward_out: Sequence[fx.Node | None]
           ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward = what ``forward_out`` (loss, sends, buffer updates) depends on, returning
    those then the values backward needs; backward = the rest, fed by the saved values
    and ``backward_phs``, returning ``backward_out`` (None where a gradient is absent)."""
    forward_nodes = set(forward_phs)
    for r in forward_out:
        forward_nodes |= _ancestors(r)
    # take a multi-output op's items in forward too (free), so backward saves tensors, not
    # tuples (autograd's save_for_backward holds tensors only)
    forward_nodes |= {u for n in forward_nodes for u in n.users
                      if u.op == "call_function" and u.target is operator.getitem}
    fwd, fenv = fx.Graph(), {}
    for n in graph.nodes:
        if n in forward_nodes:
            fenv[n] = fwd.node_copy(n, lambda x: fenv[x])
    saved = [n for n in graph.nodes if n in forward_nodes
             and (any(u not in forward_nodes for u in n.users) or n in backward_out)]
    fwd.output((*[fenv[n] for n in forward_out], *[fenv[n] for n in saved]))
    bwd, benv = fx.Graph(), {}
    for n in saved:
        benv[n] = bwd.placeholder(f"saved_{n.name}")
    for n in backward_phs:
        benv[n] = bwd.placeholder(n.name)
    for n in graph.nodes:
        if n not in forward_nodes and n.op != "output" and n not in benv:
            benv[n] = bwd.node_copy(n, lambda x: benv[x])
    bwd.output(tuple(None if n is None else benv[n] for n in backward_out))
    fwd.lint()
    bwd.lint()
    root = torch.nn.Module()
    return fx.GraphModule(root, fwd, "LocalForward"), fx.GraphModule(root, bwd, "LocalBackward")


def _steps_program(inputs: Sequence[tuple[str, Sequence[ReshardStep]]], mesh_shape, coords,
                   group_names, name: str) -> fx.GraphModule:
    """``(*inputs) -> each input after its plan steps``: the gradients' final resharding
    (``reduce_grads``), or a received gradient sum laid out as the gradient it is added to."""
    graph = fx.Graph()
    emit = _Emitter(graph, mesh_shape, coords, group_names)
    graph.output(tuple(emit.steps(graph.placeholder(n), steps) for n, steps in inputs))
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph, name)
