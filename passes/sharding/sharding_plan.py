"""The Plan of an intra-op solution: reshards, collectives, estimates and explanations.

Given each node's chosen strategy, ``assemble_plan`` lists the reshards between what a
producer writes and what each reader reads (operand reads alike sharing one copy), the
collectives those and the ops themselves run, in the order the runtime issues them, the
step's time (communication and compute, gradient accumulation counted) and memory per
device, each parameter's layout against its best alternative, and notes.
``merge_gradient_all_reduces`` then packs gradient all-reduces into buckets (Alpa's
all-reduce combiner).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph, OpNode, ValueRef
from torchalpa.core.options import AutoShardingOption, ShardParallel
from torchalpa.core.placement import Placements, format_placements, is_shard, replicated
from torchalpa.core.plan import (
    INPUT_SLOT,
    OUTPUT,
    Collective,
    MeshStage,
    NodeStrategy,
    OutputSlot,
    Plan,
    Reshard,
    ValuePlacement,
    state_read_once,
)
from torchalpa.core.plan_records import Estimates, Explanation, LayoutCost, known
from torchalpa.passes.pricing.attention_price import saved_statistics
from torchalpa.passes.pricing.cost import (
    batch_sync_cost,
    collective_cost,
    gradient_steps_cost,
    op_family,
    optimizer_cost,
    steps_cost,
    wire_bytes,
)
from torchalpa.passes.pricing.kernel_model import MATMUL_FAMILIES
from torchalpa.passes.pricing.memory import (
    KeptCopy,
    activation_peak_bytes,
    gradients_from_backward,
    model_state_bytes,
    same_layout_views,
    scatter_copies,
    view_copies,
)
from torchalpa.passes.pricing.overlap_price import CommEvent, Device, overlapped_step, program_order
from torchalpa.passes.pricing.state_gather import state_gather_bytes
from torchalpa.passes.pricing.step_end import device_type_of, end_of_step_bytes
from torchalpa.passes.pricing.sum_reduction import sum_reduction_bytes
from torchalpa.passes.sharding.costgraph import ReshardCosts, op_compute_seconds
from torchalpa.passes.sharding.reshard import local_bytes
from torchalpa.passes.sharding.shared_reshard import read_key
from torchalpa.passes.sharding.stage_boundary import boundary_layout
from torchalpa.passes.sharding.strategies import Strategy, StrategySpace, sync_steps

__all__ = ["assemble_plan", "merge_gradient_all_reduces", "replace_estimates",
           "kept_state_copies", "assumed_program_order"]


def replace_estimates(plan: Plan, **changes) -> Plan:
    """``plan`` with the named ``Estimates`` fields set to new values."""
    return replace(plan, estimates=replace(plan.estimates, **changes))


def assemble_plan(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel,
                  chosen: dict[str, Strategy], costs: ReshardCosts, space: StrategySpace,
                  inputs: str, step_micro_batches: int = 1) -> Plan:
    """The Plan of ``chosen`` (node -> strategy) for ``graph`` on ``mesh`` (module doc);
    ``space``: the strategies it was chosen from (its notes and unsupported ops go into
    the plan); ``inputs``: "global" batches are resharded from whole ones;
    ``step_micro_batches``: a pipeline stage's micro-batches per step (its ``method`` has
    one): its forward reads of parameters are resharded once per step, as the stage's
    runtime gathers them (``plan.state_read_once``)."""
    reshards = _reshards(graph, mesh, chosen, costs, inputs,
                         not method.auto_sharding_option.rematerialize_parameters)
    k = method.num_micro_batches      # gradient accumulation: all but the final reductions
    state_once = state_read_once(max(k, step_micro_batches),
                                 method.auto_sharding_option.rematerialize_parameters)
    traffic = _Traffic(graph, mesh, k)
    for r in reshards:
        traffic.add_reshard(r, state_once)
    # then the all-reduces ops make inside themselves, after every reshard's, so positions
    # of reshard collectives stay as the reshards list them
    for n in graph.ops():
        traffic.add_op(n, chosen[n.name])
    leaf_placement = {n.name: chosen[n.name].outputs[0] for n in graph if n.is_leaf}
    assert mesh.axis_names is not None  # LogicalMesh.__post_init__ fills it
    return Plan(
        explanations=_explain_parameters(graph, mesh, method, chosen, costs, space),
        mesh_shape=mesh.shape, axis_names=mesh.axis_names,
        parameters=_placements(graph, leaf_placement, ("param", "buffer")),
        inputs=_placements(graph, leaf_placement, ("input",)),
        strategies=tuple(NodeStrategy(node=n.name, inputs=chosen[n.name].inputs,
                                      outputs=chosen[n.name].outputs,
                                      batch_syncs=chosen[n.name].batch_syncs)
                         for n in graph.ops()),
        reshards=tuple(reshards), collectives=tuple(traffic.collectives),
        estimates=_estimates(graph, mesh, method, chosen, traffic, leaf_placement, state_once,
                             gradients_from_backward(max(k, step_micro_batches),
                                                     method.optimizer_states),
                             kept_state_copies(graph, chosen, reshards, mesh.shape) +
                             view_copies(graph, {k: s.outputs for k, s in chosen.items()},
                                         {k: s.inputs for k, s in chosen.items()}, mesh.shape),
                             # a parameter gathered once per step to be sent whole to
                             # another stage: the copy is held from the first forward
                             # to the last (runtime/rewrites/param_gather.py)
                             sum(graph.spec(ValueRef(r.producer, r.index)).nbytes
                                 for r in reshards if state_once and sends_parameter(graph, r)
                                 and any(st.is_collective for st in r.steps))),
        unsupported_ops=tuple(space.unsupported),
        stages=(MeshStage(layers=(0,), logical_shape=tuple(mesh.shape),
                          num_devices=mesh.num_devices),),
        method=method.to_dict(), graph_fingerprint=graph.fingerprint(),
        notes=_notes(graph, mesh, chosen, space))


class _Reshards:
    """The reshards of a plan, in order; operand reads that reshard a value alike share
    the first such read's copy."""

    def __init__(self, graph: OpGraph, chosen: dict[str, Strategy], costs: ReshardCosts,
                 share_state: bool):
        self.graph, self.chosen, self.costs = graph, chosen, costs
        self.share_state = share_state   # parameters' reads share a copy (read_key)
        self.reshards: list[Reshard] = []
        self._first_read: dict = {}     # (value, steps) -> the operand read that reshards it

    def add(self, ref: ValueRef, consumer: str, slot, dst: Placements | None) -> None:
        """``consumer`` reads ``ref`` at ``slot`` (an operand index or an output slot) in
        layout ``dst``."""
        graph, chosen = self.graph, self.chosen
        src = chosen[ref.node].outputs[ref.index]
        steps = self.costs.steps(graph.spec(ref), src, dst)
        assert steps is not None, (ref, consumer, slot, src, dst)
        if isinstance(slot, int):    # operand reads alike share one resharded copy
            key = read_key(graph, chosen, self.costs.steps, ref, dst,
                           share_state=self.share_state, phase=graph.node(consumer).phase)
            if key is not None and key in self._first_read:
                self.reshards.append(Reshard(ref.node, ref.index, consumer, slot, (),
                                             same_as=self._first_read[key]))
                return
            if key is not None:
                self._first_read[key] = (consumer, slot)
        if steps:
            self.reshards.append(Reshard(ref.node, ref.index, consumer, slot, tuple(steps)))


def _reshards(graph: OpGraph, mesh: LogicalMesh, chosen: dict[str, Strategy],
              costs: ReshardCosts, inputs: str, share_state: bool) -> list[Reshard]:
    """Every reshard of the plan: global inputs to their layouts, each operand read, the
    loss made whole, gradients and buffer updates to their owners' layouts, values sent
    to other stages made whole. ``share_state``: reads of a parameter alike share a copy
    (unless parameters are gathered again in backward)."""
    R = replicated(mesh.ndim)
    out = _Reshards(graph, chosen, costs, share_state)
    for node in graph:
        # a value received batch-split arrives in its layout (passes/sharding/stage_boundary.py)
        if node.kind == "input" and inputs == "global" and \
                boundary_layout(graph, node.name, node.output, mesh) is None:
            steps = costs.steps(node.output, R, chosen[node.name].outputs[0])
            if steps:
                out.reshards.append(Reshard(node.name, 0, node.name, INPUT_SLOT, tuple(steps)))
        for slot, ref in enumerate(node.operands):
            out.add(ref, node.name, slot, chosen[node.name].inputs[slot])
    if graph.outputs.loss is not None:
        out.add(graph.outputs.loss, OUTPUT, OutputSlot.loss(), R)
    params = graph.params
    for fqn, ref in graph.outputs.grads:
        out.add(ref, OUTPUT, OutputSlot.grad(fqn), chosen[params[fqn]].outputs[0])
    buffers = {n.target: n.name for n in graph if n.kind == "buffer"}
    for fqn, ref in graph.outputs.buffer_updates:
        out.add(ref, OUTPUT, OutputSlot.buffer(fqn), chosen[buffers[fqn]].outputs[0])
    for ref in graph.outputs.sends:
        out.add(ref, OUTPUT, OutputSlot.send(str(ref)),
                boundary_layout(graph, str(ref), graph.spec(ref), mesh) or R)
    return out.reshards


def sends_parameter(graph: OpGraph, r: Reshard) -> bool:
    """Whether ``r`` lays out a parameter another pipeline stage reads (a tied weight):
    sent once per step, and with ``plan.state_read_once`` resharded once per step, with
    the forward reads of parameters (``runtime/rewrites/param_gather.py``)."""
    return isinstance(r.slot, OutputSlot) and r.slot.kind == "send" \
        and graph.node(r.producer).kind == "param"


def kept_state_copies(graph: OpGraph, chosen: dict[str, Strategy],
                      reshards: list[Reshard], mesh_shape) -> list[KeptCopy]:
    """The resharded copies of parameters and buffers that two or more operand reads
    share (``Reshard.same_as``; ZeRO-2 gathers a weight once for forward and backward):
    each is kept from its first reader to its last, which a copy read once is not."""
    first: dict[tuple[str, int], Reshard] = {}
    readers: dict[tuple[str, int], list[str]] = {}
    for r in reshards:
        if isinstance(r.slot, int) and r.same_as is None and r.steps:
            first[(r.consumer, r.slot)] = r
        elif r.same_as is not None and r.same_as in first:
            readers.setdefault(r.same_as, [r.same_as[0]]).append(r.consumer)
    kept = []
    for read, names in readers.items():
        r, dst = first[read], chosen[read[0]].inputs[read[1]]
        if graph.node(r.producer).kind not in ("param", "buffer") or dst is None:
            continue
        spec = graph.node(r.producer).outputs[r.index]
        kept.append(KeptCopy(tuple(names), local_bytes(spec, dst, mesh_shape)))
    return kept


@dataclass
class _Traffic:
    """What one step communicates on ``mesh`` with ``k`` micro-batches: the collectives in
    the order they run, their seconds (``once_seconds`` of them paid once per step, not
    per micro-batch) and the bytes on the wire."""

    graph: OpGraph
    mesh: LogicalMesh
    k: int
    collectives: list[Collective] = field(default_factory=list)
    seconds: float = 0.0
    once_seconds: float = 0.0
    wire: float = 0.0
    events: list[CommEvent] = field(default_factory=list)
    """One micro-batch's collectives for the overlap walk (``passes/pricing/overlap_price.py``);
    what is paid once per step outside it is in ``once_serial``."""
    gradients: list[CommEvent] = field(default_factory=list)
    once_serial: float = 0.0
    index: dict[str, int] = field(default_factory=dict)
    _made_of_parameters: dict[str, bool] = field(default_factory=dict)

    def __post_init__(self):
        self.index = {n.name: i for i, n in enumerate(self.graph.ops())}

    def add_reshard(self, r: Reshard, state_once: bool) -> None:
        """A reshard's collectives: once per step for a gradient's final one and (with
        ``state_once``) a forward read of a parameter or buffer, else once per
        micro-batch."""
        graph, mesh = self.graph, self.mesh
        if isinstance(r.slot, OutputSlot):
            phase = "backward" if r.slot.kind == "grad" else graph.node(r.producer).phase
            at = graph.node(r.producer)
        else:
            phase = graph.node(r.consumer).phase
            at = graph.node(r.consumer)
        for step in r.steps:
            if step.is_collective:
                self.collectives.append(Collective(
                    kind=step.kind, axis=step.axis, bytes=step.bytes, phase=phase,
                    source=at.module, tensor=r.producer, reduce_op=step.reduce_op,
                    stack=at.stack))
        is_gradient = isinstance(r.slot, OutputSlot) and r.slot.kind == "grad"
        # a forward read of a parameter or buffer: resharded once per step (runtime's
        # param_gather), as a gradient's final resharding is; so is a gradient part sent
        # to the stage that adds it into a parameter's gradient (summed over the
        # micro-batches first: runtime/execution/pipeline.py)
        once = (state_once and isinstance(r.slot, int) and phase == "forward"
                and graph.node(r.producer).kind in ("param", "buffer")) or (
            isinstance(r.slot, OutputSlot) and r.slot.kind == "send"
            and r.slot.name in graph.meta.get("summed_sends", ())) or (
            state_once and sends_parameter(graph, r))
        times = 1 if is_gradient or once else self.k
        for step in r.steps:
            if step.is_collective:     # every group along the axis runs this collective
                groups = mesh.num_devices // mesh.shape[step.axis]
                self.wire += times * groups * wire_bytes(step.kind, mesh.shape[step.axis],
                                                         step.bytes, mesh.backend)
        seconds = (gradient_steps_cost if is_gradient else steps_cost)(mesh, r.steps)
        self.seconds += times * seconds
        self.once_seconds += seconds if is_gradient or once else 0.0
        self._event(r, at, phase, seconds, is_gradient, once)

    def _ready(self, name: str) -> int:
        """The op after which value ``name`` exists: its producer, or for a view (which
        launches nothing: the runtime moves a gradient's views up to their source,
        ``runtime/rewrites/reduce_in_backward.py``) the op its source is ready after; the last op
        for a value no op makes."""
        node = self.graph.node(name)
        if name not in self.index:
            return len(self.index) - 1
        if node.aliases and node.operands:
            return max(self._ready(ref.node) for ref in node.operands
                       if ref.node in self.index) if any(
                ref.node in self.index for ref in node.operands) else self.index[name]
        return self.index[name]

    def _event(self, r: Reshard, at: OpNode, phase: str, seconds: float, is_gradient: bool,
               once: bool) -> None:
        """How the runtime issues reshard ``r``'s collectives (``passes/pricing/overlap_price.py``)."""
        steps = [st for st in r.steps if st.is_collective and self.mesh.shape[st.axis] > 1]
        if not steps or seconds <= 0:
            return
        if is_gradient:
            self.gradients.append(CommEvent(seconds, self._ready(r.producer),
                                            steps[0].axis, "gradient", steps[0].bytes, phase,
                                            steps[0].kind))
            return
        if once:
            self.once_serial += seconds
            return
        op = self.index[at.name] if at.name in self.index else self.index.get(r.consumer, 0)
        first = steps[0]
        if first.kind == "all_gather" and isinstance(r.slot, int) \
                and self._of_parameters(r.producer):
            gather = collective_cost(self.mesh, first.kind, first.axis, first.bytes)
            self.events.append(CommEvent(gather, op, first.axis, "gather", first.bytes, phase,
                                         first.kind))
            seconds -= gather
            if seconds <= 0:
                return
        self.events.append(CommEvent(seconds, op, first.axis, "serial", 0.0, phase,
                                     first.kind))

    def _of_parameters(self, name: str) -> bool:
        """Whether value ``name`` is made from parameters alone: a parameter, or ops (no
        random draw) on parameters only, such as its cast to the compute dtype and its
        transposes. The runtime prefetches such a value's gather with the ops that make
        it (``runtime/rewrites/overlap.py``: mixed precision's cast gathers)."""
        known = self._made_of_parameters
        if name not in known:
            node = self.graph.node(name)
            known[name] = node.kind == "param" or (
                node.kind == "op" and bool(node.operands) and not _random(node.op)
                and all(self._of_parameters(ref.node) for ref in node.operands))
        return known[name]

    def add_op(self, n: OpNode, s: Strategy) -> None:
        """The all-reduces op ``n`` runs inside itself under ``s``: the statistics of a
        split softmax dim (phased, max then sum) or a batch-synced op's sums (one pass);
        never both."""
        mesh, k = self.mesh, self.k
        phased = sync_steps(s, n.outputs[0], mesh.shape)
        assert not (phased and s.batch_syncs), f"{n.name}: both phased and batch-synced"
        internal = [(st.axis, st.bytes, st.reduce_op) for st in phased] + \
            [(axis, nbytes, "sum") for axis, nbytes in s.batch_syncs]
        for axis, nbytes, reduce_op in internal:
            self.collectives.append(Collective(kind="all_reduce", axis=axis, bytes=nbytes,
                                               phase=n.phase, source=n.module, tensor=n.name,
                                               reduce_op=reduce_op, stack=n.stack))
            groups = mesh.num_devices // mesh.shape[axis]
            self.wire += k * groups * wire_bytes("all_reduce", mesh.shape[axis], nbytes,
                                                 mesh.backend)
        seconds = steps_cost(mesh, phased) + batch_sync_cost(mesh, s.batch_syncs)
        self.seconds += k * seconds
        if internal and seconds > 0:
            self.events.append(CommEvent(seconds, self.index[n.name], internal[0][0], "serial",
                                         0.0, n.phase, "all_reduce"))


_RANDOM_WORDS = ("rand", "dropout", "bernoulli", "normal", "uniform", "exponential", "rng")


def _random(op: str) -> bool:
    """Whether op ``op`` draws random numbers (by name: ATen's and StableHLO's)."""
    return any(word in op for word in _RANDOM_WORDS)


def _estimates(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel,
               chosen: dict[str, Strategy], traffic: _Traffic,
               leaf_placement: dict[str, Placements], state_once: bool,
               grads_late: bool, kept: list[KeptCopy], held: float = 0.0) -> Estimates:
    """The step's time (compute, the optimizer, and the communication the runtime does not
    hide behind compute: ``_step_seconds``; what of it is paid once per step: the
    gradients' final resharding, state reads done once, the optimizer) and memory per
    device (model states, the activation peak and what forward saves for backward, with
    the shared copies of gathered parameters, ``kept``, alive between their reads, and
    ``held`` bytes alive for the step: a tied weight gathered once per step to be sent;
    gradients with the activations from their backward op on where ``grads_late``:
    ``memory.gradients_from_backward``), as the ILP's ``MemoryModel`` counts them. An
    op's compute is priced on the bytes its strategy's blocks move."""
    k = traffic.k
    device = _device(graph, mesh)
    kernels = replace(mesh, kernel_launch_s=0.0) if device.host_s else mesh
    per_op = [op_compute_seconds(graph, kernels, n, chosen[n.name]) for n in graph.ops()]
    compute_time = k * sum(per_op)
    state = model_state_bytes(graph, leaf_placement, mesh.shape, method.optimizer_states,
                              grads_late, {name: s.outputs for name, s in chosen.items()})
    optimizer_s = optimizer_cost(mesh, {
        n.name: local_bytes(n.output, leaf_placement[n.name], mesh.shape)
        for n in graph if n.kind == "param"}, method.optimizer_states)
    compute_time += optimizer_s
    activations, saved = activation_peak_bytes(
        graph, {name: s.outputs for name, s in chosen.items()}, mesh.shape,
        saved_statistics(graph, mesh), state_at_start=state_once, kept=kept,
        grads_from_backward=grads_late, free_views=same_layout_views(
            graph, leaf_placement, {name: s.inputs for name, s in chosen.items()}),
        reduce_copies=scatter_copies(device_type_of(mesh.backend)),
        bucket_bytes=mesh.gradient_bucket_bytes)
    activations += held
    end = end_of_step_bytes(graph, leaf_placement, mesh.shape, method.optimizer,
                            method.optimizer_states, device_type_of(mesh.backend))
    if not grads_late:          # the sums over micro-batches reduced before the update
        end = max(end, sum_reduction_bytes(graph, leaf_placement,
                                           {name: s.outputs for name, s in chosen.items()},
                                           mesh.shape, method.optimizer_states,
                                           mesh.gradient_bucket_bytes))
    if state_once:              # the parameters gathered before the first micro-batch
        end = max(end, state_gather_bytes(graph, leaf_placement,
                                          {name: s.inputs for name, s in chosen.items()},
                                          mesh.shape, method.optimizer_states,
                                          device_type_of(mesh.backend),
                                          mesh.gradient_bucket_bytes))
    step, once, hidden, hidden_grads = _step_seconds(graph, mesh, traffic, per_op, optimizer_s,
                                                     device)
    return Estimates(step_time_s=step, communication_s=traffic.seconds,
                     host_s=k * sum(device.host_s) if device.host_s else None,
                     once_per_step_s=once, compute_s=compute_time,
                     hidden_communication_s=hidden, hidden_gradient_s=hidden_grads,
                     model_state_bytes_per_device=state,
                     activation_bytes_per_device=activations,
                     saved_activation_bytes_per_device=saved,
                     end_of_step_bytes_per_device=end,
                     memory_per_device_bytes=max(state + activations, end),
                     wire_bytes_per_step=traffic.wire)


def _device(graph: OpGraph, mesh: LogicalMesh) -> Device:
    """The host and contention the GPU step walk prices (``overlap_price.Device``): every
    op, views too, issued by the host at ``mesh.host_op_s`` when the program runs eagerly
    on GPUs (``eager_kernels``); nothing on CPU ranks, where ``kernel_launch_s`` adds to
    each op instead, nor without a compute model."""
    if mesh.backend != "nccl" or mesh.peak_flops is None:
        return Device()
    host = (mesh.host_op_s,) * sum(1 for _ in graph.ops()) if mesh.host_op_s and mesh.eager_kernels \
        else ()
    return Device(host_s=host, contention=mesh.contention)


def _step_seconds(graph: OpGraph, mesh: LogicalMesh, traffic: _Traffic, per_op: list[float],
                  optimizer_s: float, device: Device
                  ) -> tuple[float, float, float | None, float | None]:
    """(step seconds, of which once per step, communication hidden behind compute, of which
    the gradients' reductions). On GPUs (NCCL) the communication is overlapped as the
    runtime issues it (``passes/pricing/overlap_price.py``): parameter gathers prefetched, and with
    one micro-batch the gradients reduced while backward goes on; kernels wait for the
    host that issues them and slow down beside collectives (``device``). On CPU ranks
    (gloo) and without a compute model the step is compute + communication."""
    k = traffic.k
    serial_once = traffic.once_seconds + optimizer_s
    if mesh.backend != "nccl" or mesh.peak_flops is None:
        return k * sum(per_op) + traffic.seconds + optimizer_s, serial_once, None, None
    phases = [n.phase for n in graph.ops()]
    grad_s = sum(e.seconds for e in traffic.gradients)
    if k == 1:
        whole, micro = overlapped_step(per_op, phases, traffic.events + traffic.gradients,
                                       mesh.gradient_bucket_bytes or 25 * 2 ** 20, device)
        grads_exposed = whole - micro
    else:
        micro = overlapped_step(per_op, phases, traffic.events, 0.0, device)[1]
        grads_exposed = grad_s
    once = grads_exposed + traffic.once_serial + optimizer_s
    step = k * micro + once
    alone = overlapped_step(per_op, phases, [], 0.0, device)[1] if device.host_s \
        else sum(per_op)                  # the micro-batch without communication
    hidden = max(0.0, k * alone + traffic.seconds + optimizer_s - step)
    return step, once, hidden, grad_s - grads_exposed


def assumed_program_order(graph: OpGraph, mesh: LogicalMesh, plan: Plan) -> list[str]:
    """The order of one micro-batch's collective issues and waits and its matmuls ("mm")
    that ``plan``'s step estimate assumes on GPUs (``overlap_price.program_order``), for a
    test to hold against what the runtime issues. ``graph``: the graph ``plan`` was made
    for; the gradients' reductions are in it with one micro-batch."""
    k = int((plan.method or {}).get("num_micro_batches") or 1)
    option = (plan.method or {}).get("auto_sharding_option") or {}
    traffic = _Traffic(graph, mesh, k)
    for r in plan.reshards:
        traffic.add_reshard(r, state_read_once(k, bool(option.get("rematerialize_parameters"))))
    names = ["mm" if op_family(n.op) in MATMUL_FAMILIES else None for n in graph.ops()]
    events = traffic.events + (traffic.gradients if k == 1 else [])
    return program_order(names, [n.phase for n in graph.ops()], events,
                         mesh.gradient_bucket_bytes or 25 * 2 ** 20)


def _placements(graph: OpGraph, leaf_placement: dict[str, Placements],
                kinds: tuple[str, ...]) -> tuple[ValuePlacement, ...]:
    """The placement of every leaf of ``kinds``, by the name the user knows it by."""
    out = []
    for n in graph:
        if n.kind in kinds:
            assert n.target is not None, f"{n.name}: a {n.kind} without a target"
            out.append(ValuePlacement(name=n.target, node=n.name, shape=n.output.shape,
                                      placements=leaf_placement[n.name]))
    return tuple(out)


def _notes(graph: OpGraph, mesh: LogicalMesh, chosen: dict[str, Strategy],
           space: StrategySpace) -> tuple[str, ...]:
    """The strategy space's notes, inputs that cannot be fully data-parallel, and random
    ops drawn per block."""
    notes = list(space.notes)
    for n in graph:
        if n.kind == "input" and n.batched and n.output.shape and \
                n.output.shape[0] % mesh.num_devices:
            notes.append(f"{n.target}: batch dim {n.output.shape[0]} does not divide by "
                         f"{mesh.num_devices} devices, so it cannot be fully data-parallel")
    per_block = sorted(n for n in space.random
                       if any(is_shard(p) for p in chosen[n].outputs[0]))
    if per_block:
        notes.append(f"{len(per_block)} random ops (dropout masks...) are drawn per block: "
                     "the distribution one device draws, not its numbers; "
                     "AutoShardingOption(random='replicated') draws them whole")
    return tuple(notes)


def _explain_parameters(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel,
                        chosen: dict[str, Strategy], costs: ReshardCosts,
                        space: StrategySpace) -> dict[str, Explanation]:
    """Per parameter: what its layout costs (communication it causes, state it holds) and
    what the best other layout would cost with every other decision unchanged."""
    readers: dict[str, list[tuple[str, int]]] = {}
    for node in graph.ops():
        for slot, ref in enumerate(node.operands):
            if graph.node(ref.node).kind in ("param", "buffer"):
                readers.setdefault(ref.node, []).append((node.name, slot))
    params = graph.params          # made per call: once, not once per gradient
    grads = {params[fqn]: ref for fqn, ref in graph.outputs.grads}
    out = {}
    for node in graph:
        if node.kind not in ("param", "buffer"):
            continue

        def price(layout):
            t = sum(costs.cost(node.output, layout, chosen[v].inputs[slot])
                    for v, slot in readers.get(node.name, []))
            g = grads.get(node.name)
            if g is not None:
                t += costs.cost(graph.spec(g), chosen[g.node].outputs[g.index], layout,
                                gradient=True)
            copies = 2 + method.optimizer_states if g is not None else 1
            return LayoutCost(placements=tuple(format_placements(layout)), communication_s=t,
                              state_bytes=local_bytes(node.output, layout, mesh.shape) * copies)

        mine = chosen[node.name].outputs[0]
        others = [price(s.outputs[0]) for s in space.strategies[node.name]
                  if s.outputs[0] != mine]
        out[node.target] = Explanation(price(mine), min(
            others, key=lambda o: (o.communication_s, o.state_bytes)) if others else None)
    return out


def merge_gradient_all_reduces(plan: Plan, graph: OpGraph, mesh: LogicalMesh,
                                option: AutoShardingOption) -> Plan:
    """Alpa's all-reduce combiner on the plan: gradient all-reduces on one mesh axis are
    packed, in order, into buckets of at most ``all_reduce_threshold`` bytes; each bucket
    pays one latency instead of one per gradient. The buckets are listed in
    ``estimates.gradient_buckets`` (their tensors, and the positions of their
    collectives in ``plan.collectives``); the collectives stay listed one per gradient."""
    threshold = option.all_reduce_threshold
    if threshold is None:
        return plan
    grads = _gradient_values(graph)
    buckets: list[dict] = []
    open_bucket: dict[int, dict] = {}
    position = -1                   # plan.collectives lists the reshards' steps first, in order
    for r in plan.reshards:
        for step in r.steps:
            if not step.is_collective:
                continue
            position += 1
            if step.kind != "all_reduce" or (r.producer, r.index) not in grads \
                    or mesh.shape[step.axis] == 1:
                continue
            bucket = open_bucket.get(step.axis)
            if bucket is None or bucket["bytes"] + step.bytes > threshold:
                bucket = open_bucket[step.axis] = {"axis": step.axis, "bytes": 0,
                                                   "tensors": [], "collectives": []}
                buckets.append(bucket)
            bucket["bytes"] += step.bytes
            bucket["tensors"].append(r.producer)
            bucket["collectives"].append(position)
    assert position == sum(1 for r in plan.reshards for st in r.steps if st.is_collective) - 1
    assert mesh.alpha is not None  # LogicalMesh.__post_init__ fills it
    # a mesh that prices buckets (gradient_bucket_bytes) already charged each gradient its
    # share of a bucket's latency; Alpa's accounting charged one each, merged here
    saved = 0.0 if mesh.gradient_bucket_bytes > 0 else \
        sum((len(b["tensors"]) - 1) * mesh.alpha[b["axis"]] for b in buckets)
    e = plan.estimates
    return replace_estimates(plan, gradient_buckets=buckets,
                             step_time_s=known(e.step_time_s) - saved,
                             communication_s=known(e.communication_s) - saved)


def _gradient_values(graph: OpGraph) -> set[tuple[str, int]]:
    """Parameter gradients and the values they are views of (same size, single-result
    ops whose every use leads only to gradient outputs): what an all-reduce combiner may
    merge. Values as (node, result index)."""
    found = {(ref.node, ref.index) for _, ref in graph.outputs.grads}
    other = {(ref.node, ref.index) for ref in
             ([graph.outputs.loss] if graph.outputs.loss else [])}
    other |= {(ref.node, ref.index) for _, ref in graph.outputs.buffer_updates}
    other |= {(ref.node, ref.index) for ref in graph.outputs.sends}
    found -= other
    users: dict[tuple[str, int], list[str]] = {}
    for n in graph.ops():
        for ref in n.operands:
            users.setdefault((ref.node, ref.index), []).append(n.name)
    for n in reversed(list(graph.ops())):
        key = (n.name, 0)
        used = users.get(key, [])
        if len(n.outputs) != 1 or key in other or key in found or not used:
            continue
        if all(len(graph.node(u).outputs) == 1 and (u, 0) in found
               and graph.node(u).outputs[0].numel == n.outputs[0].numel for u in used):
            found.add(key)
    return found
