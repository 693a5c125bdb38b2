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
- **Split K** (cuBLAS's split-K and Hopper's stream-K kernels): a matmul whose output has
  fewer tiles than the GPU has SMs but a long K splits K so every SM works, and sums the
  partial tiles after (their float32 bytes written and read once more). ``wave_efficiency``
  is taken over ``tiles x splits`` at the best split, ``K / splits`` at least
  ``SPLIT_K_MIN``; ``epilogue_seconds`` adds the partial sums. Without it a weight's
  gradient over a long batch (a (256, 2048) x (2048, 1024) product: 16 tiles on 132 SMs)
  was priced at an eighth of the rate it runs at.
- **Alignment**: tensor-core GEMM kernels load their operands 16 bytes at a time (Hopper's
  TMA requires it); a 16-bit matmul with a dimension that is not a multiple of 8
  (``ALIGN_BYTES`` / itemsize: a 50257-token vocabulary) falls back to kernels that load
  element by element, at ``UNALIGNED_MATMUL_RATE`` of the aligned rate. The H200 run of
  2026-11-28 (``benchmarks/gpu_logs/h200-2026-11-28/ops.log``) timed GPT-2's vocabulary
  projections at 124-139 TFLOP/s against 802 for aligned large ones (0.15-0.17); nanoGPT's
  padding of the same vocabulary to 50304 sped a whole A100 step up ~25%, which a factor
  near 0.5 on that GPU gives. Float32 on CUDA cores needs 4-byte alignment only: not priced.
- **Eager elementwise kernels on 16-bit data**: PyTorch's vectorized elementwise kernels
  move a few elements per thread per load, so on 2-byte elements they keep half the bytes
  in flight a float32 kernel does, and fall short of the bandwidth a copy reaches. In the
  same log the kernels long enough not to wait on the timing loop's host (over ~200 us)
  show it: the bf16 logits' cast to float32 (4.9 GB) moved at 0.55 of the priced
  bandwidth, GPT-2's 24 bf16 GELUs (6 GB) at 0.79, while float32 kernels over the logits
  (fills, scatter, log-softmax: 40 GB) reached it; ``HALF_ELEMENTWISE_SHARE`` is between.
  Normalizations (layer/batch/group norm and their backwards, whose weight gradients are
  summed down the batch in a second pass) reach less: ``NORMALIZATION_SHARE``
  (GPT-2's 25 layer-norm backwards took 115 us each for 75 MB). One share per kernel
  family on 16-bit data, from that one log (no per-model constant); float32 data keeps
  the bandwidth, and so do hand-fused or compiled kernels (``AutoShardingOption(
  elementwise="fused")``: ``LogicalMesh.eager_kernels``) (``bandwidth_share``).
- **A kernel's floor**: a kernel however small occupies the device ``KERNEL_FLOOR_S``
  (launch latency and the tail of its last blocks); the host's issue cost, longer, is
  ``kernel_launch_s``'s (``passes/pricing/cost.py``).
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
           "epilogue_seconds", "moved_bytes", "bandwidth_share", "SPLIT_K_MIN", "ALIGN_BYTES",
           "UNALIGNED_MATMUL_RATE", "HALF_ELEMENTWISE_SHARE", "NORMALIZATION_SHARE",
           "KERNEL_FLOOR_S", "split_k", "unaligned"]

MATMUL_FAMILIES = frozenset({"mm", "bmm", "addmm", "baddbmm", "batched_matmul", "dot_general"})
"""Op families (``passes/pricing/cost.op_family``) that run as one GEMM."""
TILE = 128
"""Output rows and columns of one thread block of a large GEMM (cuBLAS's common 128 x 128
and 128 x 256 tiles: the guide's examples)."""
SPLIT_K_MIN = 256
"""Shortest K one split of a split-K matmul runs (a few iterations of its K loop)."""
MAX_SPLITS = 16
"""Most K splits priced (stream-K kernels spread any share of K over the SMs)."""
ALIGN_BYTES = 16
"""Bytes a tensor-core GEMM loads at a time: dims of 16-bit operands multiples of 8."""
UNALIGNED_MATMUL_RATE = 0.2
"""Share of the aligned rate an unaligned 16-bit matmul reaches (module doc)."""
HALF_ELEMENTWISE_SHARE = 0.7
"""Share of the memory bandwidth eager elementwise kernels on 16-bit data reach."""
NORMALIZATION_SHARE = 0.25
"""Share of the memory bandwidth normalizations and their backwards on 16-bit data reach."""
_NORMS = frozenset({"native_layer_norm", "native_group_norm", "native_batch_norm",
                    "native_batch_norm_legit_functional", "native_batch_norm_legit",
                    "batch_norm_backward", "rms_norm", "fused_rms_norm"})
KERNEL_FLOOR_S = 3e-6
"""Device seconds of the smallest kernel (launch latency and tail)."""
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


def _contraction(node: OpNode) -> int:
    """K of a matmul: its flops over two per output element (batch and all)."""
    out = node.outputs[0].numel
    return int(round(node.flops / (2 * out))) if out else 0


def _tiles(mesh: LogicalMesh, node: OpNode, outputs) -> int:
    shape, _ = _local_output(mesh, node, outputs, 1)
    if len(shape) < 2:
        return 0
    *batch, rows, cols = shape
    return math.prod(batch) * math.ceil(rows / TILE) * math.ceil(cols / TILE)


def _local_contraction(mesh: LogicalMesh, node: OpNode, outputs, shards: int) -> int:
    """K of this device's share of a matmul split ``shards`` ways with result ``outputs``:
    its flops over two per local output element. A weight's gradient over a batch split
    across data-parallel replicas sums its own tokens only, and a row-parallel product its
    own share of K; the whole op's K priced those as long splittable loops (GPT 7.5B on
    tp4 x dp32: K 65,536 for 2,048 local tokens). The whole K without placements."""
    k = _contraction(node)
    if outputs is None or shards <= 1:
        return k
    shape, _ = _local_output(mesh, node, outputs, 1)
    local = math.prod(shape)
    return min(k, int(round(node.flops / shards / (2 * local)))) if local else k


def split_k(mesh: LogicalMesh, node: OpNode, outputs, shards: int = 1) -> int:
    """The number of K splits this device's share of a matmul runs with (module doc): the
    one that takes least time, its flops at the ``wave_efficiency`` of ``tiles x splits``
    plus the partial tiles' float32 bytes written and read back, each split at least
    ``SPLIT_K_MIN`` of this device's K (1 on a mesh without ``multiprocessors`` or
    bandwidth); the op's flops are split ``shards`` ways."""
    sms, bandwidth = mesh.multiprocessors, mesh.memory_bandwidth
    tiles, k = _tiles(mesh, node, outputs), _local_contraction(mesh, node, outputs, shards)
    most = min(k // SPLIT_K_MIN, MAX_SPLITS) if tiles and sms else 1
    if most <= 1 or not bandwidth:
        return 1
    shape, _ = _local_output(mesh, node, outputs, 1)
    rate = mesh.peak_flops_for(node.outputs[0].dtype, "mm") or 1.0
    flops = 2.0 * math.prod(shape) * k

    def seconds(splits: int) -> float:
        fixup = 2.0 * splits * math.prod(shape) * 4 / bandwidth if splits > 1 else 0.0
        return flops / (rate * wave_efficiency(tiles * splits, sms)) + fixup
    return min(range(1, most + 1), key=seconds)


def unaligned(node: OpNode) -> bool:
    """Whether a 16-bit matmul has a dimension (rows, columns or K) that is not a multiple
    of ``ALIGN_BYTES`` over its element size."""
    out = node.outputs[0]
    if out.itemsize != 2 or len(out.shape) < 2:
        return False
    step = ALIGN_BYTES // out.itemsize
    return any(d % step for d in (*out.shape[-2:], _contraction(node)))


def matmul_efficiency(mesh: LogicalMesh, node: OpNode, family: str,
                      outputs: tuple[Placements, ...] | None, shards: int = 1) -> float:
    """The share of the matmul rate this device's share of a matmul reaches: the
    ``wave_efficiency`` of its local output's batch, rows and columns in ``TILE``-sized
    tiles, K split where that fills more SMs (``split_k``), times ``UNALIGNED_MATMUL_RATE``
    when a dimension is unaligned (module doc). 1.0 for other ops, on a mesh without
    ``multiprocessors``, or without placements. The op's flops are split ``shards`` ways."""
    if family not in MATMUL_FAMILIES or not mesh.multiprocessors or not node.outputs:
        return 1.0
    tiles = _tiles(mesh, node, outputs)
    if not tiles:
        return 1.0
    share = wave_efficiency(tiles * split_k(mesh, node, outputs, shards), mesh.multiprocessors)
    return share * UNALIGNED_MATMUL_RATE if unaligned(node) else share


def epilogue_seconds(mesh: LogicalMesh, node: OpNode, family: str,
                     outputs: tuple[Placements, ...] | None, shards: int) -> float:
    """Seconds a GPU matmul spends writing its result after its K loop (module doc): the
    local result's bytes at the memory bandwidth; 0 for other ops and on a mesh without
    ``multiprocessors`` (the GPU kernel model off)."""
    if family not in MATMUL_FAMILIES or not mesh.multiprocessors or not node.outputs \
            or not mesh.memory_bandwidth:
        return 0.0
    shape, nbytes = _local_output(mesh, node, outputs, shards)
    splits = split_k(mesh, node, outputs, shards)
    if splits > 1:       # the partial tiles in float32, written and read back to be summed
        nbytes += 2.0 * splits * math.prod(shape) * 4
    return nbytes / mesh.memory_bandwidth


def bandwidth_share(mesh: LogicalMesh, node: OpNode, family: str) -> float:
    """The share of ``mesh.memory_bandwidth`` ``node``'s kernel reaches on a GPU (module
    doc): ``NORMALIZATION_SHARE`` for normalizations, ``HALF_ELEMENTWISE_SHARE`` for other
    kernels (not matmuls, not attention) that read or write 16-bit floating data, 1.0
    otherwise, off GPUs (a mesh without ``multiprocessors``) and where fused kernels run
    them (not ``mesh.eager_kernels``)."""
    if not mesh.multiprocessors or not mesh.eager_kernels or family in MATMUL_FAMILIES \
            or family.startswith("sdpa") or family == "convolution":
        return 1.0
    floating = [s for s in node.outputs if not s.is_absent and
                s.dtype.startswith(("float", "bfloat"))]
    sizes = [float(s.itemsize) for s in floating]
    if family == "to_copy" and floating and floating[0].numel:   # a cast reads its source
        sizes.append((node.bytes - floating[0].nbytes) / floating[0].numel)
    if not sizes or min(sizes) > 2:
        return 1.0
    return NORMALIZATION_SHARE if family in _NORMS else HALF_ELEMENTWISE_SHARE


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
        # two more passes over what the kernel reads: at most its bytes once fused (a
        # compiled log-softmax over a cast it computes itself reads the cast's source)
        return node.bytes + 2.0 * min(written, node.bytes)
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
