"""passes/pricing/kernel_model.py and what compute_cost makes of it: wave quantization of matmuls,
a matmul's result written after its K loop, bytes of fills, gathers and long-row softmaxes,
fused attention's rate, the host issue cost on GPUs against CPUs, and the float32 matmul
rate."""

from __future__ import annotations

import pytest

from torchalpa.core import gpu_specs
from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import Operand, OpNode, TensorSpec
from torchalpa.core.placement import Replicate, Shard
from torchalpa.passes.pricing.cost import compute_cost
from torchalpa.passes.pricing.kernel_model import (
    SHARED_ROW_BYTES,
    TILE,
    epilogue_seconds,
    moved_bytes,
    wave_efficiency,
)


def _node(op: str, out: tuple[int, ...], dtype="bfloat16", flops=0.0, nbytes=0.0, args=()):
    return OpNode(name="n", op=op, kind="op", outputs=(TensorSpec(out, dtype),), flops=flops,
                  bytes=nbytes, args=args)


def _mm(m: int, n: int, k: int) -> OpNode:
    return _node("aten.mm.default", (m, n), flops=2.0 * m * n * k,
                 nbytes=2.0 * (m * k + k * n + m * n))


def test_a_last_partial_wave_leaves_sms_idle():
    assert wave_efficiency(132, 132) == 1.0
    assert wave_efficiency(133, 132) == pytest.approx(133 / 264)
    assert wave_efficiency(10, 132) == pytest.approx(10 / 132)
    assert wave_efficiency(10, 0) == 1.0                 # not modeled


def test_a_small_matmul_computes_at_the_share_of_sms_its_tiles_fill():
    mesh = LogicalMesh(shape=(2,), peak_flops=100e12, memory_bandwidth=1e15,
                       multiprocessors=100)
    big, small = _mm(100 * TILE, TILE, 8192), _mm(2 * TILE, TILE, 8192 * 50)
    assert big.flops == small.flops
    written = {n: n.outputs[0].nbytes / 1e15 for n in (big, small)}   # each one's epilogue
    assert compute_cost(mesh, big, 1) == pytest.approx(big.flops / 100e12 + written[big])
    assert compute_cost(mesh, small, 1) == pytest.approx(small.flops / 100e12 * 50
                                                         + written[small])
    # the strategy's local shape decides: rows split over 2 devices fill one tile each
    rows = ((Shard(0),),)
    assert compute_cost(mesh, small, 2, rows) == pytest.approx(small.flops / 2 / 1e12)
    assert compute_cost(mesh, small, 2, ((Replicate(),),)) == pytest.approx(
        small.flops / 2 / 2e12)


def test_fills_write_and_gathers_read_only_what_they_take():
    fill = _node("aten.full_like.default", (1024, 50257), "float32",
                 nbytes=2 * 1024 * 50257 * 4)
    assert moved_bytes(fill, "full_like") == 1024 * 50257 * 4
    gather = _node("aten.gather.default", (1024, 1), "float32",
                   nbytes=1024 * 50257 * 4 + 2 * 1024 * 4)
    assert moved_bytes(gather, "gather") == 2 * 1024 * 4 + 8 * 1024


def test_softmax_over_rows_longer_than_shared_memory_reads_them_per_pass():
    n = 4096
    logits = 50257                                 # float32 rows of 200 KB
    assert logits * 4 > SHARED_ROW_BYTES
    out = n * logits * 4
    lsm = _node("aten._log_softmax.default", (n, logits), "float32", nbytes=2 * out,
                args=(Operand(0), 1, False))
    assert moved_bytes(lsm, "log_softmax") == 4 * out           # 3 reads, 1 write
    back = _node("aten._log_softmax_backward_data.default", (n, logits), "float32",
                 nbytes=3 * out, args=(Operand(0), Operand(1), 1, "torch.float32"))
    assert moved_bytes(back, "log_softmax_backward_data") == 5 * out
    rows = _node("aten._softmax.default", (n, 16, 1024), "bfloat16", nbytes=4.0 * n * 16 * 1024,
                 args=(Operand(0), -1, False))                  # 2 KB rows stay on chip
    assert moved_bytes(rows, "softmax") == rows.bytes


def test_fused_attention_runs_at_its_share_of_the_dtype_rate():
    mesh = LogicalMesh(shape=(1,), peak_flops=100e12, memory_bandwidth=1e15,
                       peak_flops_by_dtype={"bfloat16": 600e12, "float32": 50e12},
                       op_rate_factors={"sdpa": 0.5})
    sdpa = _node("torchalpa.sdpa.default", (4, 16, 2048, 128), flops=1e12)
    assert compute_cost(mesh, sdpa, 1) == pytest.approx(1e12 / 300e12)
    fp32 = _node("torchalpa.sdpa.default", (4, 16, 2048, 128), "float32", flops=1e12)
    assert compute_cost(mesh, fp32, 1) == pytest.approx(1e12 / 25e12)


def test_gpu_ops_cost_the_longer_of_kernel_and_issue_cpu_ops_both():
    tiny = _mm(8, 8, 8)
    gpu = LogicalMesh(shape=(1,), peak_flops=100e12, memory_bandwidth=1e12,
                      kernel_launch_s=10e-6)
    assert compute_cost(gpu, tiny, 1) == pytest.approx(10e-6)
    big = _mm(8192, 8192, 8192)
    assert compute_cost(gpu, big, 1) == pytest.approx(big.flops / 100e12)
    cpu = LogicalMesh(shape=(1,), peak_flops=100e12, memory_bandwidth=1e12,
                      kernel_launch_s=10e-6, backend="gloo")
    assert compute_cost(cpu, big, 1) == pytest.approx(big.flops / 100e12 + 10e-6)


def test_float32_matmuls_on_cuda_cores_reach_more_of_their_peak_than_tensor_cores():
    spec = gpu_specs.lookup("NVIDIA H200")
    peaks = dict(gpu_specs.peaks_by_dtype(spec, allow_tf32=False))
    assert peaks["float32"] == pytest.approx(67e12 * gpu_specs.FP32_MATMUL_EFFICIENCY)
    assert peaks["bfloat16"] == pytest.approx(989e12 * gpu_specs.MATMUL_EFFICIENCY)
    assert gpu_specs.FP32_MATMUL_EFFICIENCY > gpu_specs.MATMUL_EFFICIENCY
    assert dict(gpu_specs.op_factors(spec))["sdpa"] == pytest.approx(
        0.35 / gpu_specs.MATMUL_EFFICIENCY)


def test_a_matmul_writes_its_result_after_its_k_loop_so_a_short_k_reaches_less_of_the_peak():
    gpu = LogicalMesh(shape=(2,), peak_flops=100e12, memory_bandwidth=1e12, multiprocessors=128)
    short_k, long_k = _mm(8192, 8192, 768), _mm(8192, 8192, 8192)
    for node in (short_k, long_k):    # the result's bytes at the bandwidth, on top of the flops
        assert epilogue_seconds(gpu, node, "mm", None, 1) == pytest.approx(8192 * 8192 * 2 / 1e12)
        assert compute_cost(gpu, node, 1) == pytest.approx(
            node.flops / 100e12 + 8192 * 8192 * 2 / 1e12)
    reached = {k: n.flops / compute_cost(gpu, n, 1) / 100e12 for k, n in
               (("short", short_k), ("long", long_k))}
    assert reached["short"] < reached["long"] < 1.0
    # a result sharded over the mesh writes only its local share
    assert epilogue_seconds(gpu, short_k, "mm", ((Shard(0),),), 1) == pytest.approx(
        8192 * 8192 * 2 / 2 / 1e12)
    assert epilogue_seconds(gpu, short_k, "mm", None, 2) == pytest.approx(8192 * 8192 / 1e12)


def test_the_epilogue_is_priced_only_for_gpu_matmuls():
    node = _mm(4096, 4096, 4096)
    cpu = LogicalMesh(shape=(1,), peak_flops=1e12, memory_bandwidth=1e10)   # no SMs modeled
    gpu = LogicalMesh(shape=(1,), peak_flops=1e12, memory_bandwidth=1e10, multiprocessors=100)
    assert epilogue_seconds(cpu, node, "mm", None, 1) == 0.0
    assert epilogue_seconds(gpu, node, "add", None, 1) == 0.0
    assert epilogue_seconds(gpu, node, "mm", None, 1) > 0.0
