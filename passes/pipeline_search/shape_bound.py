"""What every pipeline of one shape must at least take: a bound by its stages, no solver.

A pipeline candidate of the automatic search (``torchalpa.parallel.auto``) is a step of
``B`` micro-batches, each captured as ``graph``, cut into stages of contiguous layers
(``layers.assign_layers``: the very layers its search would cut) on submeshes of Alpa's
shapes (``stages.submesh_shapes``) that together take every device. Whatever stages and
intra-op plans its search then finds, its estimate
(``pipeline_assembly.pipeline_estimates``: the schedule simulated on the stages' forward,
backward and send times, plus what each stage pays once per step) is at least this bound,
for three reasons, each a property of that estimate:

1. **A stage's micro-batch.** Each device of a stage of ``d`` devices runs every op of the
   stage on its share (SPMD): an op costs it at least its roofline over ``d``
   (``cost.compute_cost`` split at most ``d`` ways, as ``bounds.py`` has it over every
   device), and at least the kernel's launch and floor, which no split shrinks (on GPUs
   the launch overlaps the kernel, so the larger of the two; on CPU ranks it adds). Where
   the host issues an eager program's kernels (``LogicalMesh.host_op_s``), the stage's
   host issues every op of the stage. A stage's time per micro-batch ``t`` is at least
   the larger of the two sums; communication, resharding and recomputation only add.
2. **The schedule.** A stage runs its ``B`` forwards and ``B`` backwards one at a time,
   ``B * t`` in all. It cannot start before micro-batch 0 went forward through every
   stage before it, and its last op is some micro-batch's backward, which the stages
   before must still carry back to the first: so the step takes at least
   ``sum(f_j, j < s) + B * t_s + sum(b_j, j < s) = B * t_s + sum(t_j, j < s)`` for every
   stage ``s`` (forward and backward together make ``t_j``; sends only add). This is
   the fill and drain every stage cut pays, without assuming a balanced cut.
3. **Memory.** A stage's devices hold at least its parameters, gradients and optimizer
   states split over all of them (``memory.state_copies``); a stage on too few devices
   for that does not fit the budget, whatever its plan.

The bound is the least, over every cut of the layers into stages and every choice of
submeshes taking all devices (more than the search may place: a relaxation), of
``max_s (B * t_s + sum(t_j, j < s))``, found by a dynamic program over (first layer,
devices left): the step of a suffix of stages is ``max(B * t, t + rest)``, increasing in
``rest``, so the least rest is the one to keep. One stage over every device is among the
cuts, so the bound never falls below what one stage would pay; its gain over
``bounds.StepProfile.pipeline_step_seconds`` is the fill and drain of a cut, and the kernels'
launches, floors and host time counted per stage instead of split evenly.

What the bound leaves out (so a plan may sit well above it): the stages' collectives --
tensor-parallel all-reduces, gradient reduction over data-parallel replicas, parameter
gathers -- and the sends between stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from torchalpa.core.cluster import Cluster, LogicalMesh
from torchalpa.core.opgraph import OpGraph
from torchalpa.passes.pipeline_search.stages import submesh_shapes
from torchalpa.passes.pricing.cost import KERNEL_FLOOR_S, compute_cost
from torchalpa.passes.pricing.fused_pricing import priced_as
from torchalpa.passes.pricing.inplace_pricing import priced_in_place
from torchalpa.passes.pricing.memory import state_copies

__all__ = ["LayerFloors", "layer_floors", "pipeline_floor_s"]


@dataclass(frozen=True)
class LayerFloors:
    """Per layer, what one micro-batch of it costs a stage at least, by the stage's size."""

    sizes: tuple[int, ...]
    """Devices of each submesh shape a stage may take (``stages.submesh_shapes``)."""
    device_s: np.ndarray
    """(layers, len(sizes)): seconds a device of a stage of that size spends on the
    layer's ops for one micro-batch at least (each op: its roofline over the stage's
    devices, its launch and floor not split)."""
    host_s: np.ndarray
    """(layers,): the host's seconds issuing the layer's ops (0 where not modeled)."""
    state_bytes: np.ndarray
    """(layers,): the layer's parameters, gradients and optimizer states, whole."""


def layer_floors(graph: OpGraph, layer: dict[str, int], cluster: Cluster, *,
                 optimizer_states: int = 2, eager: bool = True) -> LayerFloors:
    """The floors of each layer of ``graph`` (one micro-batch; ``layer``: every node's
    layer, ``layers.assign_layers``) on ``cluster``'s devices, its ops priced as the
    plans' estimates price them (``eager=False``: fused kernels, no host time), as
    ``bounds.step_profile`` does."""
    mesh: LogicalMesh = cluster.logical_mesh((cluster.num_devices,))
    graph = priced_in_place(graph if eager else priced_as(graph, "fused"))
    if not eager and mesh.eager_kernels:
        mesh = replace(mesh, eager_kernels=False)
    sizes = tuple(sorted({n * m for n, m in submesh_shapes(cluster.num_nodes,
                                                          cluster.devices_per_node)}))
    num_layers = max(layer.values(), default=0) + 1
    host_op = mesh.host_op_s if eager and mesh.backend == "nccl" and mesh.eager_kernels \
        and mesh.peak_flops is not None else 0.0
    overlaps = mesh.backend == "nccl"        # compute_cost: max(work, launch) on GPUs
    floor_op = KERNEL_FLOOR_S if mesh.multiprocessors else 0.0
    work, fixed, added, where = [], [], [], []
    for node in graph.ops():
        launch = mesh.kernel_launch_s if mesh.kernel_launch_s and not node.aliases else 0.0
        floor = 0.0 if node.aliases else floor_op
        whole = compute_cost(mesh, node, 1)
        work.append(whole if overlaps else whole - launch)
        fixed.append(max(floor, launch) if overlaps else floor)
        added.append(0.0 if overlaps else launch)
        where.append(layer[node.name])
    at = np.array(where, dtype=np.int64)
    w, f, a = (np.array(v, dtype=float) for v in (work, fixed, added))
    device = np.stack([np.bincount(at, np.maximum(w / d, f) + a, minlength=num_layers)
                       for d in sizes], axis=1) if len(at) else np.zeros((num_layers, len(sizes)))
    host = np.bincount(at, minlength=num_layers) * host_op if len(at) else np.zeros(num_layers)
    states = np.zeros(num_layers)
    for node in graph:
        if node.kind in ("param", "buffer") and node.name in layer:
            states[layer[node.name]] += node.output.nbytes * state_copies(
                graph, node.name, max(optimizer_states, 0))
    return LayerFloors(sizes, device, host.astype(float), states)


def pipeline_floor_s(floors: LayerFloors, num_devices: int, num_micro_batches: int,
                     budget: float = math.inf, fill_s: np.ndarray | None = None) -> float:
    """Seconds a pipeline of ``num_micro_batches`` micro-batches over ``num_devices``
    devices must at least take, whatever its stages (module doc); inf where no cut of the
    layers fits ``budget`` bytes per device by its states alone. A layer whose
    ``device_s`` is inf at a size is never on a stage of that size. ``fill_s``: per layer
    and size, what a stage holding it adds at least to the fill of the stages after it
    where that is less than ``device_s`` (``layer_bound.py``: its forward only); default
    ``device_s`` (forward and backward, the fill and the drain)."""
    L, B = len(floors.host_s), num_micro_batches
    top = np.zeros((1, len(floors.sizes)))
    # a layer may be barred from a size (inf: ``layer_bound.py``): counted apart, so that
    # the sums of the ranges without one stay finite
    barred = np.vstack([top, np.cumsum(~np.isfinite(floors.device_s), axis=0)])
    device = np.vstack([top, np.cumsum(np.where(np.isfinite(floors.device_s),
                                                floors.device_s, 0.0), axis=0)])
    fill = device if fill_s is None else \
        np.vstack([top, np.cumsum(np.where(np.isfinite(fill_s), fill_s, 0.0), axis=0)])
    host = np.concatenate([[0.0], np.cumsum(floors.host_s)])
    states = np.concatenate([[0.0], np.cumsum(floors.state_bytes)])
    # best[k, d]: the least max over the stages of layers k.. on d devices of
    # (B * t_s + the t of the stages before it among them)
    best = np.full((L + 1, num_devices + 1), math.inf)
    best[L, 0] = 0.0
    for k in range(L - 1, -1, -1):
        for i in range(k, L):
            held = states[i + 1] - states[k]
            for j, size in enumerate(floors.sizes):
                if size > num_devices or held / size > budget or barred[i + 1, j] > barred[k, j]:
                    continue
                t = max(device[i + 1, j] - device[k, j], host[i + 1] - host[k])
                t_fill = t if fill_s is None else fill[i + 1, j] - fill[k, j]
                rest = best[i + 1, :num_devices + 1 - size]
                step = np.maximum(B * t, t_fill + rest)
                best[k, size:] = np.minimum(best[k, size:], step)
    return float(best[0, num_devices])
