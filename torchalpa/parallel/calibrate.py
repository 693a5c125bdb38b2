"""Measure the machine a job runs on, so the planner prices what really happens.

``Cluster.local_cpu`` guesses the figures of a CPU machine (30 Gflop/s per rank, 1 GB/s
and 100 us per gloo collective). On a real machine they can be far off: 4 ranks on 2 cores
share the cores, and gloo over loopback pays a latency per collective several times the
guess (plus Python's dispatch of each call). Priced with the guesses, the search prefers
plans with many small activation collectives over data parallelism's few bucketed
all-reduces, and those plans run several times slower than DDP.

``measure_cluster()`` times, on the live process group and on every rank at once (so the
ranks share the cores as they will in training), compute in windows of ~40 ms (whole
windows: the time a rank waits for a core counts, as it does in a step):

- a 256 x 256 fp32 matmul (flop/s per rank),
- a small convolution's forward and backward (``conv_flops``: on CPUs several times slower
  per flop than a matmul; ``peak_flops_by_op["convolution"]`` prices convolutions with it),
- a large elementwise add (memory bytes/s) and a tiny ATen add (the fixed cost of any op),
- an Adam step over a few small parameters (``optimizer_tensor_s``, the optimizer's cost
  per parameter tensor: ~18 tiny ops' worth, 11 ms for the zoo GPT's 28 tensors here),
- all-reduces of a few sizes; ``fit_alpha_beta`` fits ``t = alpha + beta * 2(n-1)/n * B``
  by least squares (the ring all-reduce's time for ``B`` bytes per rank, the cost model's
  formula, so the fitted alpha and beta mean what the cost model means by them),
- a 4-byte all-reduce between bursts of compute (``in_step_latency``): inside a step the
  ranks drift apart while they compute and a collective waits for the last; on a loaded
  machine that costs a few times the back-to-back latency, and alpha is the larger of the
  two.

Every figure is the slowest rank's (a maximum over ranks), so all ranks plan with the same
cluster. The result is cached per host, backend and world size under the plan cache's
directory (``calibration/``, private like the plans), so a job measures once per machine;
delete the file, or set ``TORCHALPA_CALIBRATE=0`` to plan with ``local_cpu``'s fixed
figures. A measurement takes one to three seconds.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from torchalpa.core.cluster import GB, Cluster
from torchalpa.parallel.cache import usable_root

__all__ = ["fit_alpha_beta", "measure_cluster", "calibration_enabled", "Calibration",
           "conv_flops", "in_step_latency"]

log = logging.getLogger("torchalpa")

ALL_REDUCE_SIZES = (4, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024)
"""Bytes per rank of the all-reduces timed: latency-bound to bandwidth-bound."""
CONV_SHAPE = (8, 16, 16, 3)
"""(batch, channels, image size, kernel) of the convolution timed: a small CNN's layer."""
WINDOW_S = 0.04
"""Seconds per timing window of a compute figure (three windows each)."""
OPTIMIZER_TENSORS = 8
"""Small parameters of the Adam step timed (``optimizer_tensor_s``: its time / this)."""
IN_STEP_PAIRS = 10
"""(compute, 4-byte all-reduce) pairs per window of the in-step latency."""
_VERSION = 2


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
    """The measured figures: flops (matmul), conv_flops, memory_bandwidth, op_s, alpha,
    beta (and what they were measured on: host, backend, world_size, cores, torch).
    Without conv_flops, convolutions are priced at the matmul rate."""

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
                       peak_flops_by_op=(("convolution", float(self["conv_flops"])),)
                       if "conv_flops" in self else (),
                       optimizer_tensor_s=float(self.get("optimizer_tensor_s", 0.0)),
                       device_name=f"{self['cores']} CPU cores, {self['backend']}, measured")


def _window_time(fn: Callable[[], object], window_s: float = WINDOW_S, rounds: int = 3
                 ) -> float:
    """Seconds per call of ``fn``: calls are repeated until a window of ``window_s`` has
    passed, and the median window's time is divided by its calls (after one untimed call:
    lazy set-up). Whole windows, not single calls: with more ranks than cores a rank waits
    for a core between its calls, and a training step pays that wait, which the median of
    single calls leaves out (it read 75 Gflop/s for a matmul where windows of 4 ranks on 2
    cores read 13)."""
    fn()
    times = []
    for _ in range(rounds):
        calls = 0
        start = now = time.perf_counter()
        while now - start < window_s:
            fn()
            calls += 1
            now = time.perf_counter()
        times.append((now - start) / calls)
    return statistics.median(times)


def conv_flops(batch: int, channels: int, size: int, kernel: int) -> float:
    """Flops of a stride-1, same-padded 2-D convolution's forward plus its backward (input
    and weight gradients: twice the forward), 2 per multiply-add as ``flop_count`` counts."""
    return 3 * 2 * batch * channels * channels * kernel * kernel * size * size


def _conv_step(batch: int, channels: int, size: int, kernel: int) -> Callable[[], object]:
    """One convolution's forward and backward as the captured program calls them."""
    aten = torch.ops.aten
    x = torch.randn(batch, channels, size, size)
    w = torch.randn(channels, channels, kernel, kernel)
    pad = [kernel // 2] * 2
    y = aten.convolution(x, w, None, [1, 1], pad, [1, 1], False, [0, 0], 1)
    grad = torch.randn_like(y)

    def step():
        aten.convolution(x, w, None, [1, 1], pad, [1, 1], False, [0, 0], 1)
        aten.convolution_backward(grad, x, w, [0], [1, 1], pad, [1, 1], False, [0, 0], 1,
                                  [True, True, False])
    return step


def _adam_step(num_tensors: int) -> Callable[[], object]:
    """One ``torch.optim.Adam`` step over ``num_tensors`` small parameters with gradients:
    what the optimizer pays per tensor beyond its arithmetic. (Its first construction in a
    process imports ``torch._dynamo``, seconds, which capturing the step imports anyway.)"""
    params = [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(num_tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.Adam(params, lr=1e-4)
    return optimizer.step


def in_step_latency(with_collective_s: float, compute_only_s: float) -> float:
    """What one small collective adds to a step where compute runs between collectives:
    the time per (compute, collective) pair less the compute's own (never negative)."""
    return max(with_collective_s - compute_only_s, 0.0)


def _measure_here(world: int, backend: str) -> Calibration:
    """Time compute and all-reduces on this rank, every rank doing the same at once.

    The timing tensors come from a forked generator: measuring leaves the caller's random
    state as it was (a user's per-rank seeds included), whether or not the cache held a
    calibration already."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _measure_timings(world, backend)


def _measure_timings(world: int, backend: str) -> Calibration:
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    big = torch.randn(4 * 1024 * 1024)
    tiny = torch.randn(16)
    conv = _conv_step(*CONV_SHAPE)
    add = torch.ops.aten.add.Tensor
    adam = _adam_step(OPTIMIZER_TENSORS)
    dist.barrier()
    matmul_s = _window_time(lambda: a @ b)
    conv_s = _window_time(conv)
    optimizer_s = _window_time(adam) / OPTIMIZER_TENSORS
    add_s = _window_time(lambda: big + big)
    op_s = _window_time(lambda: add(tiny, tiny))
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
    # a 4-byte all-reduce between bursts of compute, as in a step: ranks drift apart while
    # they compute and each collective waits for the last of them
    small = buffers[0]
    burst = [torch.randn(128, 128) for _ in range(2)]

    def compute():
        for _ in range(8):
            torch.mm(burst[0], burst[1])

    def compute_then_reduce():
        compute()
        dist.all_reduce(small)
    pairs, alone = [], []
    for _ in range(2):                     # a fixed count: every rank issues as many
        pairs.append(_fixed_window(compute_then_reduce, IN_STEP_PAIRS))
        alone.append(_fixed_window(compute, IN_STEP_PAIRS))
    step_latency = in_step_latency(statistics.median(pairs), statistics.median(alone))
    figures = torch.tensor([matmul_s, conv_s, add_s, op_s, optimizer_s, step_latency,
                            *reduce_s], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)   # the slowest rank's, the same everywhere
    matmul_s, conv_s, add_s, op_s, optimizer_s, step_latency, *reduce_s = figures.tolist()
    alpha, beta = fit_alpha_beta(ALL_REDUCE_SIZES, reduce_s, world)
    return Calibration(version=_VERSION, host=socket.gethostname(), backend=backend,
                       world_size=world, cores=os.cpu_count() or 1, torch=torch.__version__,
                       flops=2 * 256 ** 3 / matmul_s,
                       conv_flops=conv_flops(*CONV_SHAPE) / conv_s,
                       memory_bandwidth=3 * big.numel() * 4 / max(add_s - op_s, 1e-9),
                       op_s=op_s, optimizer_tensor_s=optimizer_s,
                       alpha=max(alpha, step_latency), beta=beta,
                       fitted_alpha=alpha, in_step_latency=step_latency,
                       all_reduce=dict(zip(map(str, ALL_REDUCE_SIZES), reduce_s)),
                       measured_at=time.time())


def _fixed_window(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call over ``calls`` calls timed together (a count every rank shares, for
    windows that issue collectives)."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _cache_path(world: int, backend: str) -> Path | None:
    root = usable_root(create=True)
    if root is None:
        return None
    return root / "calibration" / f"{socket.gethostname()}-{backend}-w{world}-v{_VERSION}.json"


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
                           "torchalpa.runtime.execution.mesh.init_distributed) first, or plan with "
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
