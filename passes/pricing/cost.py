"""Alpa's cost model: alpha-beta collectives per mesh axis, a compute roofline.

Collective costs and wire bytes are ``torchalpa/core/collective_math.py``'s (Alpa's
alpha-beta forms per mesh axis; on gloo a reduce-scatter costs an all-reduce), shared with
the views' reports.

Gradient reductions are bucketed by the runtime (``runtime/rewrites/buckets.py``, as DDP and FSDP2
do): when the mesh says so (``gradient_bucket_bytes``), a gradient's all-reduce or
reduce-scatter (and the all-reduces over other axes right after it, which the bucket's
buffer goes through too) pays the latency in proportion to its share of a bucket, not a
whole one (``gradient_steps_cost``). Without it every collective pays its own (Alpa's accounting).

Compute: the roofline ``max(flops / rate, bytes / memory_bandwidth)`` of the local share
of an op, and its issue cost ``launch``; zero when the mesh has no ``peak_flops`` (Alpa's
communication-only setting). The rate is the mesh's for the dtype the op computes in (its
first result's: bf16 matmuls at the tensor-core rate, fp32 ones at the fp32 or TF32 rate),
times the share of the GPU a matmul's tiles keep busy (``kernel_model.matmul_efficiency``,
from the strategy's local output shape), a matmul's result written after its K loop
(``kernel_model.epilogue_seconds``), or a family's own rate: ``peak_flops_by_op``
(convolutions on CPUs, several times slower per flop than matmuls) or ``op_rate_factors``
(fused attention's share of the matmul rate, plus the exponentials a head dim under 128
takes beyond that figure: ``attention_price.head_dim_seconds``). The bytes are what the kernel moves
(``kernel_model.moved_bytes``: fills read nothing, gathers only what they take, softmax
over long rows once per pass) of the blocks this device reads and writes under the
strategy (``strategy_bytes``): a matmul whose batch is split while its weight is whole
still reads the whole weight on every device, which is what a decode step of generation
(a few tokens against large weights) spends its time on. ``launch`` is the mesh's
``kernel_launch_s``, paid by every op that launches a kernel (views launch none): on CPU
ranks (gloo) the host runs the op, so it adds; on GPUs (nccl) the host issues kernels
ahead of the device, so an op costs the longer of its kernel and its issue (a step of many
tiny kernels is host-bound, one of large kernels hides the issue): the ILP's per-op price.
The step's estimate on GPUs walks the host as a queue of its own instead, every op (views
too) at ``host_op_s`` (``passes/pricing/overlap_price.py``). Attention's backward
costs what it runs on the mesh's devices (``op_flops``: the fused CPU backward reads the
forward's saved statistic, a CUDA one runs the forward again).
"""

from __future__ import annotations

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.collective_math import alpha_beta_seconds, wire_bytes
from torchalpa.core.opgraph import OpGraph, OpNode
from torchalpa.core.placement import Placements, is_shard
from torchalpa.core.plan import bucketed_prefix
from torchalpa.ops.attention import SDPA_OP
from torchalpa.passes.pricing.attention_price import (
    ATTENTION_BACKWARDS,
    attention_backward_flops,
    attention_backward_share,
    attention_forward_flops,
    head_dim_seconds,
)
from torchalpa.passes.pricing.kernel_model import (
    KERNEL_FLOOR_S,
    bandwidth_share,
    epilogue_seconds,
    matmul_efficiency,
    moved_bytes,
)

__all__ = ["collective_cost", "steps_cost", "gradient_steps_cost", "compute_cost", "strategy_bytes",
           "all_reduce_cost", "wire_bytes", "batch_sync_cost", "op_family", "optimizer_cost", "op_flops"]


def collective_cost(mesh: LogicalMesh, kind: str, axis: int, nbytes: float) -> float:
    """Time of one collective on ``axis`` given the bytes each rank contributes."""
    n = mesh.shape[axis]
    if n == 1 or kind in ("slice", "partition"):
        return 0.0
    assert mesh.alpha is not None and mesh.beta is not None  # LogicalMesh.__post_init__
    return alpha_beta_seconds(kind, n, nbytes, mesh.alpha[axis], mesh.beta[axis],
                              mesh.backend)


def all_reduce_cost(mesh: LogicalMesh, nbytes: float, axis: int) -> float:
    """Alpa's ``device_mesh.all_reduce_cost(bytes, axis)``, for tests and reports."""
    return collective_cost(mesh, "all_reduce", axis, nbytes)


def steps_cost(mesh: LogicalMesh, steps) -> float:
    return sum(collective_cost(mesh, s.kind, s.axis, s.bytes) for s in steps)


def gradient_steps_cost(mesh: LogicalMesh, steps) -> float:
    """``steps_cost`` of a gradient's final resharding: each step the runtime carries in a
    bucket of ``mesh.gradient_bucket_bytes`` (``plan.bucketed_prefix``: a first all-reduce
    or reduce-scatter, then all-reduces over the other axes) pays the latency of its share
    of the bucket (at most one whole latency)."""
    total = steps_cost(mesh, steps)
    bucket = mesh.gradient_bucket_bytes
    if bucket > 0:
        for step in steps[:bucketed_prefix(steps, mesh.shape)]:
            assert mesh.alpha is not None  # LogicalMesh.__post_init__ fills it
            total -= mesh.alpha[step.axis] * (1 - min(1.0, step.bytes / bucket))
    return total


def batch_sync_cost(mesh: LogicalMesh, batch_syncs) -> float:
    """The sum all-reduces a batch-synced op runs inside itself (``Strategy.batch_syncs``:
    (axis, bytes) pairs, synchronized batch norm's statistics)."""
    return sum(collective_cost(mesh, "all_reduce", axis, nbytes)
               for axis, nbytes in batch_syncs)


def compute_cost(mesh: LogicalMesh, node: OpNode, shards: int,
                 outputs: tuple[Placements, ...] | None = None,
                 nbytes: float | None = None) -> float:
    """Roofline time of this device's share of ``node`` split ``shards`` ways, with its
    issue cost (module doc); ``outputs``: the strategy's result placements, which give a
    matmul's local shape; ``nbytes``: the bytes that share reads and writes
    (``strategy_bytes``; None: the op's bytes divided ``shards`` ways)."""
    if mesh.peak_flops is None:
        return 0.0
    family = op_family(node.op)
    peak = mesh.peak_flops_for(_compute_dtype(node), family)
    assert peak is not None  # peak_flops is set, so every dtype has a figure
    peak *= matmul_efficiency(mesh, node, family, outputs, shards) \
        * attention_backward_share(mesh, node)
    t = (op_flops(mesh, node) / peak + head_dim_seconds(mesh, node)) / shards \
        + epilogue_seconds(mesh, node, family, outputs, shards)
    if mesh.memory_bandwidth:
        # what the kernel moves of the op's bytes, applied to this device's blocks
        moved = moved_bytes(node, family) / shards if nbytes is None else \
            nbytes * (moved_bytes(node, family) / node.bytes if node.bytes else 1.0)
        t = max(t, moved / (mesh.memory_bandwidth * bandwidth_share(mesh, node, family)))
    if mesh.multiprocessors and not node.aliases:      # a GPU kernel's own floor
        t = max(t, KERNEL_FLOOR_S)
    if mesh.kernel_launch_s and not node.aliases:
        t = max(t, mesh.kernel_launch_s) if mesh.backend == "nccl" else t + mesh.kernel_launch_s
    return t


def strategy_bytes(graph: OpGraph, node: OpNode, inputs, outputs, mesh_shape) -> float:
    """Bytes one device reads and writes running its share of ``node`` with operand
    layouts ``inputs`` and result layouts ``outputs`` (a strategy's): ``node.bytes`` (what
    the whole op moves, as the capture or a fusion pricing says) times the share of its
    operands' and results' bytes this device's blocks hold. A view moves nothing; an
    operand read for its shape only (layout None) is not read."""
    if node.aliases or not node.bytes:
        return 0.0
    pairs = [(graph.spec(ref), p) for ref, p in zip(node.operands, inputs) if p is not None]
    pairs += [(spec, p) for spec, p in zip(node.outputs, outputs) if not spec.is_absent]
    whole = local = 0.0
    for spec, placements in pairs:
        nbytes = float(spec.nbytes)
        whole += nbytes
        for axis, p in enumerate(placements):
            if is_shard(p):
                nbytes /= mesh_shape[axis]
        local += nbytes
    return node.bytes * local / whole if whole else 0.0


def op_flops(mesh: LogicalMesh, node: OpNode) -> float:
    """The flops ``node`` runs on ``mesh``'s devices: what the capture recorded, except
    attention's backward, whose recompute depends on the device, and causal attention on
    CUDA, whose kernels skip the masked blocks (``passes/pricing/attention_price.py``)."""
    if node.op in ATTENTION_BACKWARDS and len(node.outputs) >= 3:
        return attention_backward_flops(mesh, node)
    if node.op == SDPA_OP:
        return attention_forward_flops(mesh, node)
    return node.flops


def optimizer_cost(mesh: LogicalMesh, local_param_bytes: dict[str, float],
                   optimizer_states: int) -> float:
    """Seconds of the optimizer's step on this device: ``mesh.optimizer_tensor_s`` per
    parameter tensor, plus reading and writing the local shard of each parameter, its
    gradient and its ``optimizer_states`` states once at memory bandwidth. Zero when the
    mesh has no ``optimizer_tensor_s`` (Alpa's accounting: compute and collectives only).
    ``local_param_bytes``: each parameter node's bytes on this device."""
    if not mesh.optimizer_tensor_s:
        return 0.0
    per_tensor = mesh.optimizer_tensor_s * len(local_param_bytes)
    if not mesh.memory_bandwidth:
        return per_tensor
    moved = 2 * (2 + optimizer_states) * sum(local_param_bytes.values())
    return per_tensor + moved / mesh.memory_bandwidth


def op_family(op: str) -> str:
    """The family an op's compute rate is looked up by: its name without namespace,
    overload and ``_backward`` (``aten.convolution_backward.default`` -> ``convolution``,
    ``stablehlo.convolution`` -> ``convolution``)."""
    parts = op.split(".")
    name = parts[1] if len(parts) > 1 else parts[0]
    return name.lstrip("_").removesuffix("_backward")


def _compute_dtype(node: OpNode) -> str:
    """The dtype an op computes in: its first floating result's (else its first result's)."""
    for spec in node.outputs:
        if spec.dtype.startswith(("float", "bfloat", "complex")):
            return spec.dtype
    return node.outputs[0].dtype if node.outputs else ""
