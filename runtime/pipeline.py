"""Run a PipelinePlan: each rank runs its stage's programs on micro-batches.

Lowering a stage takes the nodes of the source graph the plan gives this stage, with
values made by other stages as placeholders it receives, and splits them into

- ``forward(params, buffers, user inputs, received activations)`` -> the loss (last
  stage), activations to send, buffer updates, and what backward needs;
- ``backward(saved, received gradients)`` -> raw gradients of this stage's parameters and
  gradients to send to earlier stages;
- ``reduce_grads(raw gradients)`` -> gradients in their parameters' layouts, once per
  step after summing the micro-batches (every resharding step is linear).

Values cross stages point to point: the sender holds them whole (its plan gathers them),
receiving rank j of a stage takes them from rank ``j mod n`` of the sending stage, and
slices what it needs. A schedule (GPipe, 1F1B) orders the forward and backward work of
the micro-batches; sends are non-blocking, so a valid schedule cannot deadlock.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils._pytree import tree_map

from torchalpa.opgraph import ValueRef
from torchalpa.plan import PipelinePlan
from torchalpa.runtime.localize import localize
from torchalpa.runtime.lower import OUTPUT, _ancestors, _Emitter
from torchalpa.runtime.overlap import overlap_collectives

__all__ = ["StageProgram", "lower_stage", "PipelineRunner"]


def _received_name(producer: str, index: int) -> str:
    return f"recv_{producer}_{index}"


@dataclass
class StageProgram:
    forward: fx.GraphModule
    backward: fx.GraphModule
    reduce_grads: fx.GraphModule
    params: list[str]                  # FQNs of this stage's trainable params (program order)
    buffers: list[str]                 # FQNs of this stage's buffers / frozen params
    user_inputs: list[int]             # indices of the user inputs this stage reads
    forward_recvs: list[tuple[str, int]]   # (producer, index) received before forward
    backward_recvs: list[tuple[str, int]]  # received before backward
    forward_sends: list[tuple[str, int]]
    backward_sends: list[tuple[str, int]]
    has_loss: bool
    buffer_updates: list[str] = field(default_factory=list)
    grad_present: list[bool] = field(default_factory=list)
    # gradient parts received once per step, summed over the micro-batches by their
    # sender: (key, index among the present gradients, program laying the sum out as
    # that gradient's addend)
    summed_recvs: list[tuple[tuple[str, int], int, fx.GraphModule]] = field(default_factory=list)

    def code(self) -> str:
        return ("# forward\n" + self.forward.code + "\n# backward\n" + self.backward.code +
                "\n# reduce_grads\n" + self.reduce_grads.code)


def lower_stage(gm: fx.GraphModule, pplan: PipelinePlan, stage: int, *, param_names: list[str],
                buffer_names: list[str], buffer_updates: list[str], coords, group_names,
                device: torch.device) -> StageProgram:
    """This rank's programs for ``stage`` of ``pplan`` (``coords`` in the stage mesh)."""
    splan = pplan.stages[stage].plan
    strategies = {s.node: s for s in splan.strategies}
    reshards = {(r.consumer, r.slot): r.steps for r in splan.reshards}
    node_stage = pplan.node_stage
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    P, Bf = len(param_names), len(buffer_names)
    kinds = {ph.name: ("param", param_names[i]) if i < P else
             ("buffer", buffer_names[i - P]) if i < P + Bf else ("input", i - P - Bf)
             for i, ph in enumerate(placeholders)}
    producer_of = {}
    for n in nodes:   # getitem -> (producer, index); everything else -> (itself, 0)
        if n.op == "call_function" and n.target is operator.getitem:
            producer_of[n.name] = (producer_of[n.args[0].name][0], n.args[1])
        elif n.op != "output":
            producer_of[n.name] = (n.name, 0)

    def stage_of(name: str) -> int | None:
        p = producer_of[name][0]
        return node_stage.get(p)

    def is_user_input(name: str) -> bool:
        return kinds.get(producer_of[name][0], ("",))[0] == "input"

    included = [n for n in nodes if n.op == "call_function" and stage_of(n.name) == stage]
    transfers_in = {(t.producer, t.index): t.phase for t in pplan.transfers if t.dst_stage == stage}
    summed_in = {(t.producer, t.index) for t in pplan.transfers
                 if t.dst_stage == stage and t.once_per_step and t.phase != "forward"}
    sends_out: dict[tuple[str, int], str] = {}
    for t in pplan.transfers:
        if t.src_stage == stage:
            sends_out.setdefault((t.producer, t.index), t.phase)

    graph = fx.Graph()
    emit = _Emitter(graph, splan.mesh_shape, coords, group_names)
    env: dict[str, fx.Node] = {}
    owned_params = [(ph, kinds[ph.name][1]) for ph in placeholders
                    if kinds[ph.name][0] == "param" and node_stage.get(ph.name) == stage]
    owned_buffers = [(ph, kinds[ph.name][1]) for ph in placeholders
                     if kinds[ph.name][0] == "buffer" and node_stage.get(ph.name) == stage]
    # user inputs this stage reads, and values it receives
    reads = {a.name for n in included for a in n.all_input_nodes}
    outs = next(n for n in nodes if n.op == "output").args[0]
    loss_node = outs[0]
    grads = dict(zip(param_names, outs[1:1 + P]))
    updates = dict(zip(buffer_updates, outs[1 + P:]))
    reads |= {g.name for ph, fqn in owned_params if (g := grads.get(fqn)) is not None}
    reads |= {u.name for ph, fqn in owned_buffers if (u := updates.get(fqn)) is not None}
    user_inputs = [ph for ph in placeholders if kinds[ph.name][0] == "input" and ph.name in reads]
    received: dict[tuple[str, int], fx.Node] = {}
    forward_phs, backward_phs = [], []
    for ph, _ in owned_params + owned_buffers:
        env[ph.name] = graph.placeholder(ph.name)
        forward_phs.append(env[ph.name])
    for ph in user_inputs:
        value = graph.placeholder(ph.name)
        forward_phs.append(value)
        env[ph.name] = emit.steps(value, reshards.get((ph.name, "input"), ()))
    for key, phase in transfers_in.items():
        if key in summed_in:
            continue           # added to its gradient once per step (below), not per micro-batch
        name = _received_name(*key)
        value = graph.placeholder(name)
        (forward_phs if phase == "forward" else backward_phs).append(value)
        received[key] = emit.steps(value, reshards.get((name, "input"), ()))

    def lookup(a: fx.Node) -> fx.Node:
        if a.name in env:
            return env[a.name]
        key = producer_of[a.name]
        if key in received:
            return received[key]
        raise AssertionError(f"stage {stage} reads {a.name}, which it neither makes nor receives")

    summed_into: dict[str, tuple[tuple[str, int], int]] = {}   # add node -> (key, its slot)
    for n in included:
        if n.target is operator.getitem:
            env[n.name] = graph.call_function(operator.getitem, (lookup(n.args[0]), n.args[1]))
            continue
        summed = [(i, producer_of[a.name]) for i, a in enumerate(n.args[:2])
                  if isinstance(a, fx.Node) and producer_of[a.name] in summed_in]
        if summed:             # gradient = own part + received part: emit the own part only
            (slot, key), = summed
            other = n.args[1 - slot]
            env[n.name] = emit.steps(lookup(other), reshards.get((n.name, 1 - slot), ()))
            summed_into[n.name] = (key, slot)
            continue
        slots = iter(range(10 ** 6))

        def local_arg(a, name=n.name):
            if not isinstance(a, fx.Node):
                return a
            return emit.steps(lookup(a), reshards.get((name, next(slots)), ()))

        args = tree_map(local_arg, list(n.args))
        kwargs = {k: tree_map(local_arg, v) for k, v in n.kwargs.items()}
        target, args, kwargs = localize(n, args, kwargs, strategies[n.name], splan.mesh_shape,
                                        device, coords)
        env[n.name] = graph.call_function(target, tuple(args), kwargs)

    def value_of(key: tuple[str, int]) -> fx.Node:
        if key in received:
            return received[key]
        producer, index = key
        getter = next((n for n in nodes if n.op == "call_function" and
                       n.target is operator.getitem and n.args[0].name == producer
                       and n.args[1] == index), None)
        return env[getter.name] if getter is not None else env[producer]

    has_loss = stage_of(loss_node.name) == stage
    loss_value = emit.steps(lookup(loss_node), reshards.get((OUTPUT, "loss"), ())) \
        if has_loss else None
    send_values = {key: emit.steps(value_of(key),
                                   reshards.get((OUTPUT, f"send:{_ref(key)}"), ()))
                   for key in sends_out}
    raw_grads = [None if grads.get(fqn) is None else lookup(grads[fqn]) for _, fqn in owned_params]
    update_values = [lookup(updates[fqn]) for _, fqn in owned_buffers if fqn in updates]
    update_values = [emit.steps(v, reshards.get((OUTPUT, f"buffer:{fqn}"), ()))
                     for v, (_, fqn) in zip(update_values,
                                            [b for b in owned_buffers if b[1] in updates])]

    present = [fqn for (_, fqn), g in zip(owned_params, raw_grads) if g is not None]
    summed_recvs = []
    for add_name, (key, slot) in summed_into.items():
        fqn = next(f for f in present if grads[f].name == add_name)
        summed_recvs.append((key, present.index(fqn),
                             _addend(key, [reshards.get((_received_name(*key), "input"), ()),
                                           reshards.get((add_name, slot), ())],
                                     splan.mesh_shape, coords, group_names)))

    forward_sends = [k for k, ph in sends_out.items() if ph == "forward"]
    backward_sends = [k for k, ph in sends_out.items() if ph != "forward"]
    roots = ([loss_value] if loss_value is not None else []) + \
        [send_values[k] for k in forward_sends] + update_values
    forward_nodes = set(forward_phs)
    for r in roots:
        forward_nodes |= _ancestors(r)
    forward_nodes |= {u for n in forward_nodes for u in n.users
                      if u.op == "call_function" and u.target is operator.getitem}
    fwd, bwd = _split(graph, forward_nodes, backward_phs,
                      forward_out=roots, backward_out=[g for g in raw_grads if g is not None] +
                      [send_values[k] for k in backward_sends])
    reduce = _reduce(splan, coords, group_names,
                     [reshards.get((OUTPUT, f"grad:{fqn}"), ())
                      for (_, fqn), g in zip(owned_params, raw_grads) if g is not None])
    for m in (fwd, bwd, reduce):
        overlap_collectives(m)
    return StageProgram(
        forward=fwd, backward=bwd, reduce_grads=reduce,
        params=[fqn for _, fqn in owned_params], buffers=[fqn for _, fqn in owned_buffers],
        user_inputs=[kinds[ph.name][1] for ph in user_inputs],
        forward_recvs=[k for k, ph in transfers_in.items() if ph == "forward"],
        backward_recvs=[k for k, ph in transfers_in.items()
                        if ph != "forward" and k not in summed_in],
        forward_sends=forward_sends, backward_sends=backward_sends, has_loss=has_loss,
        buffer_updates=[fqn for _, fqn in owned_buffers if fqn in updates],
        grad_present=[g is not None for g in raw_grads], summed_recvs=summed_recvs)


def _addend(key, steps_list, mesh_shape, coords, group_names) -> fx.GraphModule:
    """The received sum, laid out as the gradient it is added to."""
    graph = fx.Graph()
    emit = _Emitter(graph, mesh_shape, coords, group_names)
    value = graph.placeholder(_received_name(*key))
    for steps in steps_list:
        value = emit.steps(value, steps)
    graph.output((value,))
    return fx.GraphModule(torch.nn.Module(), graph, "SummedGradient")


def _ref(key: tuple[str, int]) -> str:
    return str(ValueRef(*key))


def _split(graph: fx.Graph, forward_nodes: set, backward_phs: list, forward_out: list,
           backward_out: list) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward program (outputs ``forward_out`` + saved), backward program (``backward_out``)."""
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
    bwd.output(tuple(benv[n] for n in backward_out))
    fwd.lint()
    bwd.lint()
    root = torch.nn.Module()
    return fx.GraphModule(root, fwd, "StageForward"), fx.GraphModule(root, bwd, "StageBackward")


def _reduce(splan, coords, group_names, steps_per_grad) -> fx.GraphModule:
    graph = fx.Graph()
    emit = _Emitter(graph, splan.mesh_shape, coords, group_names)
    outs = [emit.steps(graph.placeholder(f"grad_{i}"), steps)
            for i, steps in enumerate(steps_per_grad)]
    graph.output(tuple(outs))
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph, "StageReduceGrads")


class PipelineRunner:
    """Runs one rank's stage through a schedule and exchanges values with other stages."""

    def __init__(self, program: StageProgram, pplan: PipelinePlan, stage: int, rank: int,
                 specs: dict[tuple[str, int], tuple[tuple[int, ...], torch.dtype]],
                 device: torch.device):
        self.program, self.pplan, self.stage, self.rank = program, pplan, stage, rank
        self.device = device
        self.specs = specs
        mine = pplan.stages[stage].ranks
        self.position = mine.index(rank)
        # (key, peer stage) -> transfer number, shared by both ends
        self.tag_of = {(t.producer, t.index, t.src_stage, t.dst_stage): i
                       for i, t in enumerate(pplan.transfers)}
        # parameters another stage reads: sent with the first micro-batch of a step only;
        # gradient parts another stage only adds up: summed here, sent after the last
        self.once = {(t.producer, t.index) for t in pplan.transfers
                     if t.once_per_step and t.phase == "forward"}
        self.summed = {(t.producer, t.index) for t in pplan.transfers
                       if t.once_per_step and t.phase != "forward"}
        self._step_values: dict = {}     # received this step
        self._step_sent: set = set()
        self._sums: dict = {}

    def _peers_to(self, dst_stage: int) -> list[int]:
        mine = self.pplan.stages[self.stage].ranks
        theirs = self.pplan.stages[dst_stage].ranks
        return [r for j, r in enumerate(theirs) if j % len(mine) == self.position]

    def _peer_from(self, src_stage: int) -> int:
        theirs = self.pplan.stages[src_stage].ranks
        return theirs[self.position % len(theirs)]

    def _tag(self, key, src, dst, micro):
        return self.tag_of[(key[0], key[1], src, dst)] * 100_003 + micro

    def send(self, key, value: torch.Tensor, micro: int, pending: list) -> None:
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
                for peer in self._peers_to(t.dst_stage):
                    pending.append(dist.isend(value, peer,
                                              tag=self._tag(key, self.stage, t.dst_stage, micro)))

    def recv(self, key, micro: int) -> torch.Tensor:
        if key in self.once:
            if key not in self._step_values:
                self._step_values[key] = self._receive(key, micro)
            return self._step_values[key]
        return self._receive(key, micro)

    def _receive(self, key, micro: int) -> torch.Tensor:
        src = next(t.src_stage for t in self.pplan.transfers
                   if (t.producer, t.index) == key and t.dst_stage == self.stage)
        shape, dtype = self.specs[key]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.irecv(buf, self._peer_from(src), tag=self._tag(key, src, self.stage, micro)).wait()
        return buf

    def run(self, actions, state: list[torch.Tensor], micro_inputs: list[list[torch.Tensor]],
            saved: dict, grads_acc: list, losses: list, updates: list) -> None:
        """Execute ``actions`` (("F", m) / ("B", m)) of this stage: one training step."""
        p = self.program
        pending: list = []
        self._step_values, self._step_sent, self._sums = {}, set(), {}
        for kind, m in actions:
            if kind == "F":
                received = [self.recv(k, m) for k in p.forward_recvs]
                out = p.forward(*state, *[micro_inputs[m][i] for i in p.user_inputs], *received)
                out = list(out)
                if p.has_loss:
                    losses.append(out.pop(0))
                for k in p.forward_sends:
                    self.send(k, out.pop(0), m, pending)
                for _ in p.buffer_updates:
                    updates.append(out.pop(0))
                saved[m] = out
            else:
                received = [self.recv(k, m) for k in p.backward_recvs]
                out = list(p.backward(*saved.pop(m), *received))
                n = sum(p.grad_present)
                for i, g in enumerate(out[:n]):
                    grads_acc[i] = g if grads_acc[i] is None else grads_acc[i] + g
                for k, v in zip(p.backward_sends, out[n:]):
                    self.send(k, v, m, pending)
        if any(kind == "B" for kind, _ in actions):
            for k, total in self._sums.items():     # micro -1: the step's one message
                self.send(k, total, -1, pending)
            for k, position, addend in p.summed_recvs:
                part = addend(self._receive(k, 0))[0]
                grads_acc[position] = part if grads_acc[position] is None else \
                    grads_acc[position] + part
        for work in pending:
            work.wait()


def transfer_specs(gm: fx.GraphModule, plan: PipelinePlan
                   ) -> dict[tuple[str, int], tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every value crossing stages, from the source graph."""
    vals = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    specs = {}
    for t in plan.transfers:
        val = vals[t.producer]
        if isinstance(val, (list, tuple)):
            val = val[t.index]
        specs[(t.producer, t.index)] = (tuple(val.shape), val.dtype)
    return specs
