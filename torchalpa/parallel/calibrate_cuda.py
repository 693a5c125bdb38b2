"""Time this machine's GPU for the planner: ``torchalpa calibrate`` on CUDA.

``measure_device()`` runs, on one device, each for a few hundred milliseconds:

- matmuls of every ``device_profile.MATMUL_SHAPES`` class in bfloat16, float16, float32
  with TF32 off (PyTorch's default) and on (``"tf32"``): flop/s per dtype and class;
- a large copy: memory bandwidth (bytes read + written per second);
- a stream of tiny adds issued back to back: the host's time per op (what
  ``kernel_launch_s`` prices: Python, ATen's dispatch, the launch);
- causal attention forward and backward (``F.scaled_dot_product_attention``, the kernel
  torch picks) in bfloat16: flop/s as the cost model counts attention's flops.

Kernel times come from CUDA events around several calls (after warm-up calls that pick
cuBLAS's algorithms and fill the allocator), the median of a few rounds. The result is a
``DeviceProfile``; ``torchalpa calibrate`` stores it where ``default_cluster`` finds it.
The same code runs on a CPU device with small shapes (tests), where the events are wall
clock and the figures mean nothing for a GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from torchalpa.parallel.device_profile import (
    ATTENTION_SHAPE,
    MATMUL_SHAPES,
    DeviceProfile,
    attention_flops,
    matmul_flops,
)

__all__ = ["measure_device", "seconds_per_call", "MATMUL_DTYPES"]

MATMUL_DTYPES = ("bfloat16", "float16", "float32", "tf32")
"""The profile's matmul keys: "float32" with TF32 off, "tf32" with it on."""
COPY_BYTES = 1 << 30
"""Bytes of the tensor copied to time memory bandwidth (1 GiB: far above any cache)."""
TINY_OPS = 2000
"""Tiny adds issued back to back to time the host's cost per op."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], device: torch.device, *, calls: int = 5,
                     rounds: int = 3, warmup: int = 2) -> float:
    """Median over ``rounds`` of the device time of ``calls`` calls of ``fn``, per call
    (CUDA events on a GPU, the wall clock elsewhere), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _matmul_rate(m: int, n: int, k: int, dtype: str, device: torch.device) -> float:
    """flop/s of an (m, k) x (k, n) matmul in ``dtype`` ("tf32": float32 with TF32 on)."""
    torch_dtype = torch.float32 if dtype == "tf32" else getattr(torch, dtype)
    a = torch.randn(m, k, device=device, dtype=torch_dtype)
    b = torch.randn(k, n, device=device, dtype=torch_dtype)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        seconds = seconds_per_call(lambda: torch.mm(a, b), device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return matmul_flops(m, n, k) / seconds


def _bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a copy of ``nbytes`` (it reads and writes them)."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds_per_call(lambda: dst.copy_(src), device)


def _op_seconds(device: torch.device, count: int) -> float:
    """Host seconds per op of ``count`` tiny adds issued back to back, then waited for."""
    x = torch.ones(16, device=device)
    add = torch.ops.aten.add.Tensor
    for _ in range(10):
        add(x, x)
    _sync(device)
    start = time.perf_counter()
    for _ in range(count):
        add(x, x)
    _sync(device)
    return (time.perf_counter() - start) / count


def _attention_rate(shape: tuple[int, int, int, int], dtype: torch.dtype,
                    device: torch.device) -> float:
    """Priced flop/s (``attention_flops``) of causal attention forward + backward."""
    batch, heads, seq, dim = shape
    q, k, v = (torch.randn(batch, heads, seq, dim, device=device, dtype=dtype,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, heads, seq, dim, device=device, dtype=dtype)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)
    return attention_flops(*shape) / seconds_per_call(step, device)


def measure_device(device: torch.device | str | None = None, *,
                   shapes: dict[str, tuple[int, int, int]] | None = None,
                   attention_shape: tuple[int, int, int, int] = ATTENTION_SHAPE,
                   copy_bytes: int = COPY_BYTES, tiny_ops: int = TINY_OPS,
                   dtypes: tuple[str, ...] = MATMUL_DTYPES) -> DeviceProfile:
    """The profile of ``device`` (default: this process's CUDA device; module doc)."""
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("torchalpa calibrate measures a CUDA device and "
                               f"torch.cuda.is_available() is False (PyTorch "
                               f"{torch.__version__}); on CPUs the gloo calibration runs by "
                               "itself inside auto_parallel (torchalpa/parallel/calibrate.py)")
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shapes = shapes or MATMUL_SHAPES
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        matmul = {dtype: {cls: _matmul_rate(m, n, k, dtype, device)
                          for cls, (m, n, k) in shapes.items()} for dtype in dtypes}
        bandwidth = _bandwidth(device, copy_bytes)
        op_s = _op_seconds(device, tiny_ops)
        attention = {"bfloat16": _attention_rate(attention_shape, torch.bfloat16, device)}
    return DeviceProfile(device_name=name, torch_version=torch.__version__, matmul=matmul,
                         memory_bandwidth=bandwidth, op_s=op_s, attention=attention)
