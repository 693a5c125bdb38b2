"""Measurements for side-by-side runs: model-state bytes, loopback bytes, step time, peak
memory."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchalpa.core.cluster import cuda_selected
from torchalpa.runtime.measurement.host_memory import peak_rss_bytes, reset_peak

__all__ = ["local_nbytes", "model_state_bytes", "loopback_bytes", "timed_steps",
           "reset_peak_memory", "peak_memory_bytes"]


def local_nbytes(t: torch.Tensor | None) -> int:
    """Bytes this rank holds for ``t`` (its shard if ``t`` is a DTensor)."""
    if t is None:
        return 0
    return t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes


def model_state_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state tensors held by this rank."""
    total = 0
    for p in params:
        total += local_nbytes(p) + local_nbytes(p.grad)
        for v in optimizer.state.get(p, {}).values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += local_nbytes(v)
    return total


def loopback_bytes() -> int:
    """Bytes received on ``lo`` so far (counts everything local ranks exchange over TCP).

    Exact for one job when run inside ``shared/tools/netns_bytes.sh`` (a private network
    namespace); outside one it also counts other local traffic.
    """
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[0])
    return 0


def timed_steps(step: Callable[[], None], num_steps: int, warmup: int = 1) -> dict:
    """Run ``step`` ``warmup + num_steps`` times; seconds per step and loopback bytes per
    step over the timed ones (barriers around each so ranks are measured together)."""
    for _ in range(warmup):
        step()
    dist.barrier()
    bytes_before = loopback_bytes()
    times = []
    for _ in range(num_steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    dist.barrier()
    bytes_after = loopback_bytes()
    slowest = torch.tensor(times)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"step_s": float(slowest.mean()), "loopback_bytes_per_step":
            (bytes_after - bytes_before) / max(num_steps, 1)}


def reset_peak_memory() -> None:
    """Start a new peak-memory window (CUDA allocator peak, or this process's peak RSS)."""
    if cuda_selected():
        torch.cuda.reset_peak_memory_stats()
        return
    reset_peak()


def peak_memory_bytes() -> int:
    """Peak memory since ``reset_peak_memory``: allocated CUDA bytes, or peak RSS on CPU
    (the whole process: libraries and allocator caches included)."""
    if cuda_selected():
        return torch.cuda.max_memory_allocated()
    return peak_rss_bytes()
