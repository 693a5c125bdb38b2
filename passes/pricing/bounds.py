"""What any plan of a captured step must at least cost, found without a solver.

Every value a plan holds is, on each device, at least its size divided by the device
count (a shard over all of them; replicas and partial sums hold more), and every op's
time is at least its roofline over all devices (``passes/pricing/cost.compute_cost`` with every
device sharing it; collectives only add). Laid over the step's liveness -- the order the
memory model and the ILP use -- that gives, in one pass over the graph:

- a memory lower bound per device: model states (parameters, gradients, optimizer
  states; a step of one micro-batch holds each gradient from its backward op on) plus
  the largest set of activations alive at once, all split over every device;
- a step-time lower bound: the roofline of every op split over every device, plus each
  kernel's launch (on GPUs, where a launch overlaps its kernel, the larger of the two
  totals), plus the optimizer's step on the smallest possible shard; where the
  host issues the ops of an eager program on GPUs (``LogicalMesh.host_op_s``), at least
  the host's time for them (the device cannot start a kernel before it is issued).
  Each op's bytes are those the plans' estimates price (``elementwise="fused"``: a fused
  chain's, at the fused kernels' bandwidth; an in-place write's entries), else the
  bound would sit above the estimates it must stay below and prune plans that win.
  A pipeline's stages issue and launch only their own ops, so there the host's time and
  the launches count split over the most stages it may have
  (``StepProfile.pipeline_step_seconds``).

A mesh whose memory bound exceeds the budget cannot fit, whatever layout the ILP would
choose, so it is refused in milliseconds instead of after building and solving the ILP;
the bounds also rank and prune the candidates of the automatic method search
(``torchalpa.parallel.auto``).

Micro-batches: the graph is captured for one batch size ``batch``. Every value's bytes
and every op's flops and bytes grow as ``c + l * m`` with the micro-batch size ``m``
(``c, l >= 0``), so for ``m <= batch`` scaling the whole figure by ``m / batch`` is still
a lower bound (``c + l*m >= (c + l*batch) * m / batch``), and for ``m >= batch`` the figure
at ``batch`` is. That keeps the bounds sound for any micro-batch count from one capture
(an op quadratic in the batch, such as a contrastive batch x batch matrix, would break
the premise; it is priced exactly once captured at its own size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from torchalpa.core.cluster import Cluster, LogicalMesh
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.optimizer_step import FOREACH_TEMPORARIES, LOOP_TEMPORARIES
from torchalpa.passes.pricing.cost import compute_cost, optimizer_cost
from torchalpa.passes.pricing.fused_pricing import priced_as
from torchalpa.passes.pricing.inplace_pricing import priced_in_place
from torchalpa.passes.pricing.memory import forward_end, liveness, state_copies, viewed_leaf
from torchalpa.passes.pricing.step_end import trained_parameters, updates_on_device

__all__ = ["StepProfile", "step_profile", "captured_batch"]


@dataclass(frozen=True)
class StepProfile:
    """Lower bounds of one captured step (``step_profile``), for any device count and
    micro-batch size. Sizes are of the whole step, before any split."""

    batch: int
    """The micro-batch size the step was captured for (dim 0 of its inputs)."""
    state_bytes: float
    """Parameters, their gradients and optimizer states (``passes/pricing/memory.state_copies``)."""
    parameter_bytes: float
    """Parameters alone (each device holds them whole when they are replicated)."""
    activation_peak_bytes: float
    """Activations alive at once at the step's worst point."""
    activation_saved_bytes: float
    """Activations alive where forward ends: what a micro-batch holds until backward."""
    roofline_s: float
    """Every op's roofline on one device (max of flops at peak and bytes at bandwidth)."""
    launch_s: float
    """Kernel launches of one micro-batch (a fixed cost per op, whatever its size)."""
    host_s: float
    """The host's time issuing one micro-batch's ops (GPUs, eager programs: every op, views
    too, at ``host_op_s``; 0 when not modeled): a micro-batch takes at least this."""
    mesh: LogicalMesh
    """The device the figures are priced on (peak flop/s, bandwidth, launch cost)."""
    optimizer_states: int
    num_parameter_tensors: int
    gradient_bytes: float = 0.0
    """Parameters' gradients, part of ``state_bytes``: held for the whole step where it
    accumulates them over micro-batches, else from the op that makes each
    (``memory.gradients_from_backward``)."""
    activations: np.ndarray | None = field(default=None, compare=False, repr=False)
    """Activations alive at each point of the step (their peak: ``activation_peak_bytes``)."""
    gradients: np.ndarray | None = field(default=None, compare=False, repr=False)
    """Gradients alive at each point of a step of one micro-batch (made by then)."""
    optimizer_temporary_bytes: float = 0.0
    """The optimizer update's temporaries at the step's end, the parameters whole
    (``passes/pricing/step_end.py``): the least of its two implementations', so that
    split over ``n`` devices it stays a bound for each."""
    launch_overlaps: bool = False
    """Whether a kernel's launch overlaps its work (GPUs: ``compute_cost`` takes the
    larger of the two, and ``roofline_s`` holds each op's whole price) rather than adding
    to it (CPU ranks: ``roofline_s`` holds each op's price less its launch)."""

    def _late(self, micro_batch: int | None) -> bool:
        """Whether a step of micro-batches of ``micro_batch`` holds its gradients only
        from their backward ops on: the captured batch, one micro-batch per step."""
        return self._scale(micro_batch) == 1.0 and self.activations is not None \
            and self.gradients is not None

    def _scale(self, micro_batch: int | None) -> float:
        if micro_batch is None:
            return 1.0
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        return min(1.0, micro_batch / self.batch)

    def memory_bytes(self, devices: int, micro_batch: int | None = None, *,
                     in_flight: int = 1, replicated_parameters: bool = False) -> float:
        """Bytes each of ``devices`` must at least hold, running micro-batches of
        ``micro_batch`` (default: as captured), ``in_flight`` of them waiting for their
        backward at once (a pipeline stage's), with model states whole on every device
        when ``replicated_parameters`` (data parallelism: gradients and optimizer states
        follow the parameters' layout) or split over all of them."""
        _check_devices(devices)
        scale = self._scale(micro_batch)
        spread = 1 if replicated_parameters else devices    # states' (and gradients') split
        # the step's end: every state and gradient, and the update's temporaries
        end = (self.state_bytes + self.optimizer_temporary_bytes) / spread
        if in_flight == 1 and self._late(micro_batch):
            # one micro-batch: its gradients alive from their backward ops on
            assert self.activations is not None and self.gradients is not None
            alive = self.activations / devices + self.gradients / spread
            return max(end, (self.state_bytes - self.gradient_bytes) / spread +
                       float(alive.max()))
        activations = (self.activation_peak_bytes
                       + (in_flight - 1) * self.activation_saved_bytes) * scale / devices
        return max(end, self.state_bytes / spread + activations)

    def pipeline_memory_bytes(self, devices: int, micro_batch: int | None = None) -> float:
        """Bytes each of ``devices`` must at least hold when they run the step as pipeline
        stages: at the moment the first micro-batch's backward starts, every stage still
        holds what forward saved for it, so the activations alive where forward ends (not
        the step's peak) are the part every split must carry."""
        _check_devices(devices)
        state = self.state_bytes - self.gradient_bytes if self._late(micro_batch) \
            else self.state_bytes     # one micro-batch: no gradient made yet where forward ends
        return (state + self.activation_saved_bytes * self._scale(micro_batch)) / devices

    def step_seconds(self, devices: int, num_micro_batches: int = 1,
                     micro_batch: int | None = None) -> float:
        """Seconds a step of ``num_micro_batches`` micro-batches (of ``micro_batch``,
        default ``batch / num_micro_batches``) must at least take on ``devices``: each op
        at its roofline over all of them, each launch paid per micro-batch, the optimizer
        on an even shard once."""
        _check_devices(devices)
        if micro_batch is None:
            micro_batch = max(1, self.batch // num_micro_batches)
        work = self.roofline_s * self._scale(micro_batch) / devices
        # launches overlapping work: each op pays the larger of the two, so the sum is at
        # least each total (the ops split over the devices share the roofline, not the
        # launches); adding to it: both
        per_micro = max(max(work, self.launch_s) if self.launch_overlaps
                        else work + self.launch_s, self.host_s)
        shard = {f"p{i}": self.parameter_bytes / self.num_parameter_tensors / devices
                 for i in range(self.num_parameter_tensors)}
        return num_micro_batches * per_micro + optimizer_cost(self.mesh, shard,
                                                              self.optimizer_states)

    def pipeline_step_seconds(self, devices: int, num_micro_batches: int = 1,
                              micro_batch: int | None = None, *, max_stages: int = 1
                              ) -> float:
        """Seconds a pipeline of at most ``max_stages`` stages on ``devices`` must at least
        take for ``num_micro_batches`` micro-batches (``step_seconds`` with one stage).

        Each stage's devices run only its own ops, so the host's issuing and the kernel
        launches of a micro-batch are split among the stages: the stage that issues the
        most still issues a ``1 / max_stages`` share (``step_seconds`` charges every
        device all of them, more than a stage of many pays: a pipeline of host-bound
        stages beat that figure). Each stage runs every micro-batch and then its
        optimizer's step, so weighting the stages by their devices, the step takes at
        least every op at its roofline over all devices, every launch paid by at least
        one device, plus the optimizer's reads and writes of an even shard (its
        per-tensor cost, paid by each stage for its own tensors, is left out)."""
        if max_stages <= 1:
            return self.step_seconds(devices, num_micro_batches, micro_batch)
        _check_devices(devices)
        if micro_batch is None:
            micro_batch = max(1, self.batch // num_micro_batches)
        shard = {f"p{i}": self.parameter_bytes / self.num_parameter_tensors / devices
                 for i in range(self.num_parameter_tensors)}
        # optimizer_cost is a per-tensor cost plus the bytes moved: keep the bytes
        per_tensor = (self.mesh.optimizer_tensor_s or 0.0) * len(shard)
        moved = optimizer_cost(self.mesh, shard, self.optimizer_states) - per_tensor
        roofline = self.roofline_s * self._scale(micro_batch)
        # where launches overlap their kernels (GPUs) a device's op costs the larger of the
        # two, so the devices' time together is at least each total, not their sum
        per_micro = max(roofline, self.launch_s) if self.launch_overlaps \
            else roofline + self.launch_s
        work = num_micro_batches * per_micro / devices
        issued = num_micro_batches * max(self.launch_s, self.host_s) / max_stages
        return max(work + moved, issued)

    def devices_to_fit(self, budget: float, micro_batch: int | None = None) -> int:
        """The fewest devices whose memory bound fits ``budget`` bytes each."""
        if budget <= 0:
            raise ValueError(f"budget must be > 0 bytes, got {budget}")
        whole = self.memory_bytes(1, micro_batch)
        return max(1, math.ceil(whole / budget))


def captured_batch(graph: OpGraph) -> int:
    """The batch size a step was captured for: dim 0 of its first user input (1 when no
    input has a dim)."""
    for node in graph:
        if node.kind == "input" and node.batched and node.output.shape:
            return int(node.output.shape[0])
    return 1


def step_profile(graph: OpGraph, hardware: Cluster | LogicalMesh, *, batch: int | None = None,
                 optimizer_states: int = 2, eager: bool = True,
                 optimizer: str | None = None) -> StepProfile:
    """The bounds of ``graph`` (one step captured for micro-batches of ``batch``, default
    ``captured_batch(graph)``) on the devices of ``hardware``; ``eager=False`` where the
    plan prices fused kernels (``elementwise="fused"``: no host time); ``optimizer``
    (``ShardParallel.optimizer``): its update's temporaries count at the step's end. One
    pass over the
    graph: about a tenth of a second on thousands of ops."""
    batch = captured_batch(graph) if batch is None else batch
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    mesh = hardware if isinstance(hardware, LogicalMesh) else \
        hardware.logical_mesh((hardware.num_devices,))
    live = liveness(graph, fused=not eager)
    # the ops' bytes and kernels as the plans' estimates price them (``intra_op_problem``,
    # ``effective_option``): fused chains move less, in-place writes only their entries,
    # and fused kernels reach the full bandwidth; a roofline of the captured bytes is
    # above a fused plan's estimate (GPT-2 124M on 2 RTX 4090: 1.97 s against 1.34)
    graph = priced_in_place(graph if eager else priced_as(graph, "fused"))
    if not eager and mesh.eager_kernels:
        mesh = replace(mesh, eager_kernels=False)
    # a view of a parameter or buffer read in the leaf's own layout allocates nothing
    # (``memory.same_layout_views``): a plan may read every one so
    sizes = np.array([0.0 if viewed_leaf(graph, v) is not None else
                      sum(o.nbytes for i, o in enumerate(graph.node(v).outputs)
                          if k in (None, i)) for v, k in live.entries()], dtype=float)
    timeline = live.total(sizes) if len(sizes) else np.zeros(1)
    leaves = [n for n in graph if n.kind in ("param", "buffer")]
    state = sum(n.output.nbytes * state_copies(graph, n.name, optimizer_states) for n in leaves)
    grads = state - sum(n.output.nbytes * state_copies(graph, n.name, optimizer_states, True)
                        for n in leaves)
    late = liveness(graph, grads_from_backward=True, fused=not eager)   # the gradients
    by_param = {n.name: n.output.nbytes for n in graph if n.kind == "param"}
    heads = {head for _, head in late.kept_of.values()}    # kept buffers: not every plan's
    gradients = late.total([by_param[name] if k is None and name in by_param
                            and i not in heads else 0.0
                            for i, (name, k) in enumerate(late.entries())])
    params = [n for n in leaves if n.kind == "param"]
    roofline = launches = 0.0
    ops = list(graph.ops())
    host = len(ops) * mesh.host_op_s if eager and mesh.backend == "nccl" \
        and mesh.eager_kernels and mesh.peak_flops is not None else 0.0
    overlaps = mesh.backend == "nccl" and not host    # compute_cost: max(work, launch)
    for node in ops:
        launch = mesh.kernel_launch_s if mesh.kernel_launch_s and not node.aliases else 0.0
        roofline += compute_cost(mesh, node, 1) - (0.0 if overlaps else launch)
        launches += launch if not host else 0.0      # the host's time stands for launches
    return StepProfile(
        batch=batch, state_bytes=float(state),
        parameter_bytes=float(sum(n.output.nbytes for n in params)),
        activation_peak_bytes=float(timeline.max()),
        activation_saved_bytes=float(timeline[min(forward_end(graph), len(timeline) - 1)]),
        roofline_s=roofline, launch_s=launches, host_s=host, mesh=mesh,
        optimizer_states=optimizer_states, num_parameter_tensors=max(1, len(params)),
        gradient_bytes=float(grads) if optimizer_states >= 0 else 0.0,
        activations=timeline, gradients=gradients if optimizer_states >= 0 else None,
        optimizer_temporary_bytes=_least_temporaries(graph, optimizer, optimizer_states),
        launch_overlaps=overlaps)


def _least_temporaries(graph: OpGraph, optimizer: str | None, optimizer_states: int) -> float:
    """The update's temporaries, the parameters whole, in the cheaper of its two
    implementations (``core/optimizer_step.py``): 0 without an optimizer or off the
    devices."""
    if optimizer is None or not updates_on_device(optimizer, optimizer_states):
        return 0.0
    sizes = [graph.node(name).output.nbytes for name in trained_parameters(graph)]
    if not sizes:
        return 0.0
    return float(min(FOREACH_TEMPORARIES.get(optimizer, 1) * sum(sizes),
                     LOOP_TEMPORARIES.get(optimizer, 2) * max(sizes)))


def _check_devices(devices: int) -> None:
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
