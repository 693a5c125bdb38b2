"""Measure the machine a job runs on, so the planner prices what really happens.

``Cluster.local_cpu`` guesses the figures of a CPU machine (30 Gflop/s per rank, 1 GB/s
and 100 us per gloo collective). On a real machine they can be far off: 4 ranks on 2 cores
share the cores, and gloo over loopback pays a latency per collective several times the
guess (plus Python's dispatch of each call). Priced with the guesses, the search prefers
plans with many small activation collectives over data parallelism's few bucketed
all-reduces, and those plans run several times slower than DDP.

``measure_cluster()`` times, on the live process group and on every rank at once (so the
ranks share the cores as they will in training):

- a 256 x 256 fp32 matmul (flop/s per rank),
- a large elementwise add (memory bytes/s) and a tiny one (the fixed cost of any op),
- all-reduces of a few sizes; ``fit_alpha_beta`` fits ``t = alpha + beta * 2(n-1)/n * B``
  by least squares (the ring all-reduce's time for ``B`` bytes per rank, the cost model's
  formula, so the fitted alpha and beta mean what the cost model means by them).

Every figure is the slowest rank's (a maximum over ranks), so all ranks plan with the same
cluster. The result is cached per host, backend and world size under the plan cache's
directory (``calibration/``, private like the plans), so a job measures once per machine;
delete the file, or set ``TORCHALPA_CALIBRATE=0`` to plan with ``local_cpu``'s fixed
figures. A measurement takes a second or two.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from torchalpa.cluster import GB, Cluster

__all__ = ["fit_alpha_beta", "measure_cluster", "calibration_enabled", "Calibration"]

log = logging.getLogger("torchalpa")

ALL_REDUCE_SIZES = (4, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024)
"""Bytes per rank of the all-reduces timed: latency-bound to bandwidth-bound."""
_VERSION = 1


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float], n: int
                   ) -> tuple[float, float]:
    """(alpha s, beta s/byte) of ``t = alpha + beta * 2(n-1)/n * B`` fitted to all-reduce
    timings of ``B`` = ``sizes`` bytes per rank on ``n`` ranks, by least squares on the
    relative error (each timing weighted by 1/t^2: the latency-bound small sizes count as
    much as the large ones, whose absolute noise would otherwise decide alpha). A fit
    whose intercept comes out negative is refitted through the origin (alpha 0); beta is
    kept positive."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"fit_alpha_beta needs two or more (size, seconds) pairs, got "
                         f"{len(sizes)} sizes and {len(seconds)} timings")
    if n < 2:
        raise ValueError(f"fit_alpha_beta needs n >= 2 ranks, got {n}")
    x = [2 * (n - 1) / n * float(b) for b in sizes]
    y = [float(t) for t in seconds]
    if any(t <= 0 for t in y):
        raise ValueError(f"fit_alpha_beta needs positive timings, got {y}")
    w = [1 / t ** 2 for t in y]
    sw = sum(w)
    mx = sum(wi * xi for wi, xi in zip(w, x)) / sw
    my = sum(wi * yi for wi, yi in zip(w, y)) / sw
    sxx = sum(wi * (xi - mx) ** 2 for wi, xi in zip(w, x))
    if sxx == 0:
        raise ValueError("fit_alpha_beta needs at least two different sizes")
    beta = sum(wi * (xi - mx) * (yi - my) for wi, xi, yi in zip(w, x, y)) / sxx
    alpha = my - beta * mx
    if alpha < 0:
        alpha = 0.0
        beta = sum(wi * xi * yi for wi, xi, yi in zip(w, x, y)) / \
            sum(wi * xi * xi for wi, xi in zip(w, x))
    return alpha, max(beta, 1e-15)


def calibration_enabled() -> bool:
    """Whether default clusters are measured (``TORCHALPA_CALIBRATE``, default on)."""
    value = os.environ.get("TORCHALPA_CALIBRATE", "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"TORCHALPA_CALIBRATE must be 0 or 1, got {value!r}")
    return value in ("1", "true", "on")


class Calibration(dict):
    """The measured figures: flops, memory_bandwidth, op_s, alpha, beta (and what they
    were measured on: host, backend, world_size, cores, torch)."""

    def cluster(self) -> Cluster:
        """A one-node cluster of ``world_size`` devices with these figures."""
        return Cluster(num_nodes=1, devices_per_node=int(self["world_size"]),
                       memory_per_device=8 * GB, peak_flops=float(self["flops"]),
                       memory_bandwidth=float(self["memory_bandwidth"]),
                       intra_node_bandwidth=1.0 / float(self["beta"]),
                       intra_node_latency=float(self["alpha"]),
                       inter_node_bandwidth=1.0 / float(self["beta"]),
                       inter_node_latency=float(self["alpha"]), backend=str(self["backend"]),
                       kernel_launch_s=float(self["op_s"]), name="measured",
                       device_name=f"{self['cores']} CPU cores, {self['backend']}, measured")


def _median_time(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure_here(world: int, backend: str) -> Calibration:
    """Time compute and all-reduces on this rank, every rank doing the same at once."""
    torch.manual_seed(0)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    big = torch.randn(4 * 1024 * 1024)
    tiny = torch.randn(16)
    dist.barrier()
    matmul_s = _median_time(lambda: a @ b, 20)
    add_s = _median_time(lambda: big + big, 5)
    op_s = _median_time(lambda: tiny + tiny, 200)
    buffers = [torch.zeros(max(size // 4, 1)) for size in ALL_REDUCE_SIZES]
    for t in buffers:
        dist.all_reduce(t)                 # connections and buffers set up
    dist.barrier()
    timings: list[list[float]] = [[] for _ in buffers]
    for rep in range(7):                   # sizes interleaved: a burst of load hits them all
        for t, times in zip(buffers, timings):
            if rep >= 3 and t.numel() * 4 > 2 ** 20:
                continue                   # the largest are slow and steady: 3 suffice
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
    reduce_s = [statistics.median(times) for times in timings]
    figures = torch.tensor([matmul_s, add_s, op_s, *reduce_s], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)   # the slowest rank's, the same everywhere
    matmul_s, add_s, op_s, *reduce_s = figures.tolist()
    alpha, beta = fit_alpha_beta(ALL_REDUCE_SIZES, reduce_s, world)
    return Calibration(version=_VERSION, host=socket.gethostname(), backend=backend,
                       world_size=world, cores=os.cpu_count() or 1, torch=torch.__version__,
                       flops=2 * 256 ** 3 / matmul_s,
                       memory_bandwidth=3 * big.numel() * 4 / max(add_s - op_s, 1e-9),
                       op_s=op_s, alpha=alpha, beta=beta,
                       all_reduce=dict(zip(map(str, ALL_REDUCE_SIZES), reduce_s)),
                       measured_at=time.time())


def _cache_path(world: int, backend: str) -> Path | None:
    from torchalpa.cache import _usable_root
    root = _usable_root(create=True)
    if root is None:
        return None
    return root / "calibration" / f"{socket.gethostname()}-{backend}-w{world}.json"


def _load(path: Path | None, world: int, backend: str) -> Calibration | None:
    if path is None or not path.is_file() or path.is_symlink():
        return None
    try:
        data = Calibration(json.loads(path.read_text()))
        if data.get("version") != _VERSION or data.get("world_size") != world or \
                data.get("backend") != backend or data.get("torch") != torch.__version__:
            return None
        data.cluster()                     # every figure present and valid
        return data
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the unreadable calibration %s (%s); measuring again", path, e)
        return None


def _store(path: Path | None, data: Calibration) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not cache the calibration as %s: %s", path, e)


def measure_cluster() -> Cluster:
    """The cluster this process group runs on, measured (or read from the cache).

    Collective: every rank of the default process group must call it. Rank 0 reads the
    cache and tells the others whether to measure, so all ranks return the same cluster.
    """
    if not dist.is_initialized():
        raise RuntimeError("measure_cluster() needs a process group: call "
                           "torch.distributed.init_process_group (or "
                           "torchalpa.runtime.mesh.init_distributed) first, or plan with "
                           "Cluster.local_cpu(n)")
    world, backend = dist.get_world_size(), str(dist.get_backend())
    if backend != "gloo":
        raise ValueError(f"measure_cluster() times CPU tensors over gloo; this group uses "
                         f"{backend!r} (on GPUs, Cluster.detect() describes the hardware)")
    path = _cache_path(world, backend) if dist.get_rank() == 0 else None
    box = [_load(path, world, backend) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    data = box[0]
    if data is None:
        start = time.perf_counter()
        data = _measure_here(world, backend)
        log.info("measured this machine in %.1f s: %.3g Gflop/s per rank, all-reduce alpha "
                 "%.0f us, %.3g GB/s", time.perf_counter() - start, data["flops"] / 1e9,
                 data["alpha"] * 1e6, 1e-9 / data["beta"])
        if dist.get_rank() == 0:
            _store(path, data)
    return Calibration(data).cluster()
