"""What one op's kernel costs on a GPU beyond its flops over the peak and bytes over the
bandwidth: effects of an op's shape that come from how GPU kernels are written, the same
for every model.

- **Wave quantization** (NVIDIA's "Matrix Multiplication Background" guide): a matmul splits
  its output into tiles of about ``TILE`` x ``TILE`` elements, one thread block each, and
  runs them in waves of one block per streaming multiprocessor. A last, partial wave leaves
  SMs idle, so a matmul of ``t`` tiles on ``s`` SMs computes at ``t / (ceil(t / s) * s)``
  of the rate. Small per-device matmuls -- tensor parallelism's slices, short micro-batches
  -- pay it; large ones fill many waves and do not. ``wave_efficiency``.
- **The epilogue**: each tile's thread block runs its K loop, then writes its piece of the
  result; the write does not overlap the loop, so a matmul takes its flops at the large-
  matmul rate *plus* its result's bytes at the memory bandwidth. That is why a matmul
  over a short K (GPT-2 small's 768, attention's 64) reaches less of the peak than one over
  a long K: the rate falls as ``K / (K + K0)``, ``K0`` the GPU's flops per byte times the
  result's element size over two (H100: ~280 for bf16, A100 80GB ~140).
  ``epilogue_seconds``.
- **Normalizations over long rows**: PyTorch's softmax and log-softmax kernels (and their
  backwards) keep a row in registers or shared memory when it fits, reading it once; a row
  over ``SHARED_ROW_BYTES`` (a 50k-token vocabulary's logits in float32: 200 KB) is read
  once per pass -- max, sum of exponentials, write -- three times forward, twice (gradient
  and output) backward. ``moved_bytes``.
- **Ops that read less than their operands**: a fill (``full_like``, ``zeros_like``) writes
  its result and reads nothing; a gather (``gather``, ``index_select``, ``embedding``) reads
  as many elements as it writes, not its whole source. Captured bytes count every operand
  whole; ``moved_bytes`` counts what these kernels touch.

Families are ``passes/pricing/cost.op_family``'s names (``aten._log_softmax.default`` ->
``log_softmax``). The factors are read from the op's node (shapes, dtype, arguments) and, for matmuls, from
the strategy's output placements (the local shape), so the ILP prices each strategy's own
kernel.
"""

from __future__ import annotations

import math

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpNode
from torchalpa.core.placement import Placements, local_shape

__all__ = ["MATMUL_FAMILIES", "TILE", "SHARED_ROW_BYTES", "wave_efficiency", "matmul_efficiency",
           "epilogue_seconds", "moved_bytes"]

MATMUL_FAMILIES = frozenset({"mm", "bmm", "addmm", "baddbmm", "batched_matmul", "dot_general"})
"""Op families (``passes/pricing/cost.op_family``) that run as one GEMM."""
TILE = 128
"""Output rows and columns of one thread block of a large GEMM (cuBLAS's common 128 x 128
and 128 x 256 tiles: the guide's examples)."""
SHARED_ROW_BYTES = 48 * 1024
"""Largest row PyTorch's softmax kernels keep on chip (a block's default shared memory):
longer rows are read from memory once per pass."""
_NORMALIZATIONS = frozenset({"softmax", "log_softmax", "softmax_backward_data",
                             "log_softmax_backward_data"})
"""Families read once per pass when the row is long: forward reads its input twice more
(max, sum, then the read that writes), backward its gradient and output once more (sum,
then the read that writes): two more result-sized reads either way."""
_FILLS = frozenset({"full_like", "zeros_like", "ones_like", "empty_like"})
_GATHERS = frozenset({"gather", "index_select", "embedding"})


def wave_efficiency(tiles: int, multiprocessors: int) -> float:
    """The share of SM time a kernel of ``tiles`` equal blocks keeps busy when every SM runs
    one block at a time (1.0 when ``multiprocessors`` is 0: not modeled)."""
    if multiprocessors <= 0 or tiles <= 0:
        return 1.0
    waves = math.ceil(tiles / multiprocessors)
    return tiles / (waves * multiprocessors)


def _local_output(mesh: LogicalMesh, node: OpNode, outputs: tuple[Placements, ...] | None,
                  shards: int) -> tuple[tuple[int, ...], float]:
    """(shape, bytes) of this device's share of the op's first result: from the strategy's
    placements, else the whole result over ``shards``."""
    out = node.outputs[0]
    if outputs is None:
        return out.shape, out.nbytes / shards
    shape = local_shape(out.shape, outputs[0], mesh.shape)
    return shape, float(math.prod(shape) * out.itemsize)


def matmul_efficiency(mesh: LogicalMesh, node: OpNode, family: str,
                      outputs: tuple[Placements, ...] | None) -> float:
    """``wave_efficiency`` of this device's share of a matmul: its local output's batch,
    rows and columns in ``TILE``-sized tiles (1.0 for other ops, on a mesh without
    ``multiprocessors``, or without placements)."""
    if family not in MATMUL_FAMILIES or not mesh.multiprocessors or not node.outputs:
        return 1.0
    shape, _ = _local_output(mesh, node, outputs, 1)
    if len(shape) < 2:
        return 1.0
    *batch, rows, cols = shape
    tiles = math.prod(batch) * math.ceil(rows / TILE) * math.ceil(cols / TILE)
    return wave_efficiency(tiles, mesh.multiprocessors)


def epilogue_seconds(mesh: LogicalMesh, node: OpNode, family: str,
                     outputs: tuple[Placements, ...] | None, shards: int) -> float:
    """Seconds a GPU matmul spends writing its result after its K loop (module doc): the
    local result's bytes at the memory bandwidth; 0 for other ops and on a mesh without
    ``multiprocessors`` (the GPU kernel model off)."""
    if family not in MATMUL_FAMILIES or not mesh.multiprocessors or not node.outputs \
            or not mesh.memory_bandwidth:
        return 0.0
    return _local_output(mesh, node, outputs, shards)[1] / mesh.memory_bandwidth


def moved_bytes(node: OpNode, family: str) -> float:
    """The bytes ``node``'s kernel moves (module doc), from the captured ``node.bytes``
    (operands and results whole, less what a fused pricing took off)."""
    if not node.outputs:
        return node.bytes
    written = sum(spec.nbytes for spec in node.outputs if not spec.is_absent)
    if family in _FILLS:
        return min(node.bytes, float(written))
    if family in _GATHERS:
        return min(node.bytes, 2.0 * written + _index_bytes(node))
    if family in _NORMALIZATIONS and _row_bytes(node) > SHARED_ROW_BYTES:
        return node.bytes + 2.0 * written
    return node.bytes


def _index_bytes(node: OpNode) -> float:
    """Bytes of the indices a gather reads: one int64 per gathered row (its last dim whole)."""
    out = node.outputs[0]
    rows = out.numel // out.shape[-1] if out.shape and out.shape[-1] else out.numel
    return 8.0 * rows


def _row_bytes(node: OpNode) -> float:
    """Bytes of one row a normalization reduces over (its ``dim`` argument's extent)."""
    out = node.outputs[0]
    dims = [a for a in node.args if isinstance(a, int) and not isinstance(a, bool)]
    if not out.shape or not dims:
        return 0.0
    dim = dims[0] % len(out.shape)
    return float(out.shape[dim] * out.itemsize)
