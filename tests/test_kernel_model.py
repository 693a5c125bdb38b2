"""passes/pricing/kernel_model.py and what compute_cost makes of it: wave quantization of matmuls,
a matmul's result written after its K loop, K split to fill the SMs, unaligned 16-bit
matmuls, eager kernels on 16-bit data and normalizations below the bandwidth, a kernel's
floor, bytes of fills, gathers and long-row softmaxes, fused attention's rate (its backward
lower), convolutions' rate, the host issue cost on GPUs against CPUs, and the float32
matmul rate."""

from __future__ import annotations

import pytest

from torchalpa.core import gpu_specs
from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import Operand, OpNode, TensorSpec
from torchalpa.core.placement import Replicate, Shard
from torchalpa.passes.pricing.cost import compute_cost, op_flops
from torchalpa.passes.pricing.kernel_model import (
    KERNEL_FLOOR_S,
    SHARED_ROW_BYTES,
    SPLIT_K_MIN,
    TILE,
    bandwidth_share,
    epilogue_seconds,
    matmul_efficiency,
    moved_bytes,
    split_k,
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
    mesh = LogicalMesh(shape=(2,), peak_flops=1e12, memory_bandwidth=1e15,
                       multiprocessors=100)
    # K too short to split (under two SPLIT_K_MIN): the tiles alone decide
    big, small = _mm(100 * TILE, TILE, 8), _mm(2 * TILE, TILE, 8 * 50)
    assert big.flops == small.flops
    written = {n: n.outputs[0].nbytes / 1e15 for n in (big, small)}   # each one's epilogue
    assert compute_cost(mesh, big, 1) == pytest.approx(big.flops / 1e12 + written[big])
    assert compute_cost(mesh, small, 1) == pytest.approx(small.flops / 1e12 * 50
                                                         + written[small])
    # the strategy's local shape decides: rows split over 2 devices fill one tile each
    rows = ((Shard(0),),)
    assert compute_cost(mesh, small, 2, rows) == pytest.approx(small.flops / 2 / 1e10)
    assert compute_cost(mesh, small, 2, ((Replicate(),),)) == pytest.approx(
        small.flops / 2 / 2e10)


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
    assert peaks["bfloat16"] == pytest.approx(989e12 * gpu_specs.HOPPER_MATMUL_EFFICIENCY)
    assert gpu_specs.FP32_MATMUL_EFFICIENCY > gpu_specs.MATMUL_EFFICIENCY
    assert dict(gpu_specs.op_factors(spec))["sdpa"] == pytest.approx(
        0.35 / gpu_specs.HOPPER_MATMUL_EFFICIENCY)


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


def _gpu(**kw) -> LogicalMesh:
    return LogicalMesh(shape=(1,), peak_flops=100e12, memory_bandwidth=1e12,
                       multiprocessors=100, **kw)


def test_a_long_k_splits_so_a_few_output_tiles_still_fill_the_sms():
    gpu = _gpu()
    few = _mm(5 * TILE, 2 * TILE, 100 * SPLIT_K_MIN)       # 10 tiles on 100 SMs, K long
    assert split_k(gpu, few, None) == 10
    assert matmul_efficiency(gpu, few, "mm", None) == pytest.approx(1.0)
    short = _mm(5 * TILE, 2 * TILE, SPLIT_K_MIN)           # K too short to split
    assert matmul_efficiency(gpu, short, "mm", None) == pytest.approx(10 / 100)
    # the partial tiles are summed in float32 after: more epilogue than an unsplit result
    assert epilogue_seconds(gpu, few, "mm", None, 1) > epilogue_seconds(gpu, short, "mm", None, 1)
    assert split_k(gpu, _mm(20 * TILE, 10 * TILE, 100 * SPLIT_K_MIN), None) == 1  # whole waves
    # a second wave barely begun: split where the partial sums cost less than idle SMs
    late = _mm(101 * TILE, TILE, 64 * SPLIT_K_MIN)
    assert matmul_efficiency(gpu, late, "mm", None) > 0.8 > 0.6 > wave_efficiency(101, 100)


def test_an_unaligned_16_bit_matmul_runs_slower_per_flop_than_an_aligned_one():
    gpu = _gpu()
    aligned, vocab = _mm(8192, 50304, 768), _mm(8192, 50257, 768)
    per_flop = {n: compute_cost(gpu, n, 1) / n.flops for n in (aligned, vocab)}
    assert per_flop[vocab] > 3 * per_flop[aligned]
    odd_k = _mm(8192, 8192, 775)
    assert compute_cost(gpu, odd_k, 1) / odd_k.flops > 3 * per_flop[aligned]
    # float32 on CUDA cores loads element by element anyway: no penalty
    fp32 = [_node("aten.mm.default", (8192, n), "float32", flops=2.0 * 8192 * n * 768)
            for n in (50304, 50257)]
    assert matmul_efficiency(gpu, fp32[0], "mm", None) == pytest.approx(
        matmul_efficiency(gpu, fp32[1], "mm", None))


def test_eager_kernels_on_16_bit_data_and_normalizations_run_below_the_bandwidth():
    gpu = _gpu()
    n = 16384 * 768
    add16 = _node("aten.add.Tensor", (16384, 768), nbytes=3 * 2.0 * n)
    add32 = _node("aten.add.Tensor", (16384, 768), "float32", nbytes=3 * 4.0 * n)
    norm = _node("aten.native_layer_norm.default", (16384, 768), nbytes=2 * 2.0 * n)
    floor = {x: x.bytes / 1e12 for x in (add16, add32, norm)}    # bytes at the bandwidth
    assert compute_cost(gpu, add32, 1) == pytest.approx(floor[add32])
    assert compute_cost(gpu, add16, 1) > 1.3 * floor[add16]
    assert compute_cost(gpu, norm, 1) / floor[norm] > compute_cost(gpu, add16, 1) / floor[add16]
    cast = _node("aten._to_copy.default", (16384, 768), "float32", nbytes=6.0 * n)  # bf16 in
    assert bandwidth_share(gpu, cast, "to_copy") < 1.0
    # fused kernels (a compiler's, Megatron's) stream at the bandwidth
    assert compute_cost(_gpu(eager_kernels=False), norm, 1) == pytest.approx(floor[norm])
    # off GPUs (no SMs modeled) every kernel streams at the bandwidth
    cpu = LogicalMesh(shape=(1,), peak_flops=100e12, memory_bandwidth=1e12)
    assert compute_cost(cpu, norm, 1) == pytest.approx(floor[norm])
    # however small, a GPU kernel occupies the device its floor
    assert compute_cost(gpu, _node("aten.add.Tensor", (8,), nbytes=48.0), 1) == KERNEL_FLOOR_S


def test_attention_backward_runs_below_its_forward_rate_and_convolutions_below_matmuls():
    mesh = LogicalMesh(shape=(1,), peak_flops=100e12, memory_bandwidth=1e15,
                       peak_flops_by_dtype={"bfloat16": 600e12, "float32": 50e12,
                                            "tf32": 300e12},
                       op_rate_factors={"sdpa": 0.5, "convolution": 0.2})
    q = TensorSpec((4, 16, 2048, 128), "bfloat16")
    forward = _node("torchalpa.sdpa.default", (4, 16, 2048, 128), flops=1e12)
    backward = OpNode(name="b", op="torchalpa.sdpa_backward.default", kind="op",
                      outputs=(q, q, q))
    rate = {n: compute_cost(mesh, n, 1) and op_flops(mesh, n) / compute_cost(mesh, n, 1)
            for n in (forward, backward)}
    assert rate[backward] < rate[forward] == pytest.approx(300e12)
    conv = _node("aten.convolution.default", (64, 64, 56, 56), "float32", flops=1e12)
    assert compute_cost(mesh, conv, 1) == pytest.approx(1e12 / (300e12 * 0.2))   # TF32
    mm32 = _node("aten.mm.default", (4096, 4096), "float32", flops=1e12)
    assert compute_cost(mesh, mm32, 1) == pytest.approx(1e12 / 50e12)           # not TF32


def test_split_k_weighs_this_devices_share_of_k_not_the_whole_ops():
    """A weight's gradient over a batch split across 32 data-parallel replicas sums 2,048
    local tokens, not the 65,536 of the whole op: priced against the whole K, its partial
    sums looked cheap beside 32x the flops and a split was taken that costs more than it
    saves (GPT 7.5B on tp4 x dp32 went 4.18 -> 4.52 s)."""
    dp = LogicalMesh(shape=(32,), peak_flops=100e12, memory_bandwidth=1e12, multiprocessors=100)
    grad = _mm(4096, 4096, 32 * 2048)                      # 1,024 tiles on 100 SMs
    whole = ((Replicate(),),)                                 # partial sums, all-reduced after
    local = _mm(4096, 4096, 2048)                             # one replica's own product
    assert split_k(dp, grad, whole, 32) == split_k(_gpu(), local, None) == 1
    assert matmul_efficiency(dp, grad, "mm", whole, 32) == pytest.approx(
        matmul_efficiency(_gpu(), local, "mm", None))
    assert compute_cost(dp, grad, 32, whole) == pytest.approx(compute_cost(_gpu(), local, 1))
    assert split_k(dp, grad, None) > 1                        # the whole op alone would split
