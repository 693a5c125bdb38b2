"""What the benchmarks that time steps in their own process share (dtensor_grad_glue.py,
host_overhead.py, loop_vs_ddp.py; the side-by-side ones launched through torchrun by the
script itself use ``_launch.py``): the argument parser titled by the script's docstring, the
process (one thread; no process group, a gloo group of this process alone, or torchrun's
ranks; left at the end), and timing: the median of repeated calls on a chosen clock, and a
mark of wall time, this thread's CPU time and the process's minor page faults.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

__all__ = ["parser", "benchmark_process", "median_time", "mark"]


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser described by the first line of the script's docstring."""
    return argparse.ArgumentParser(description=doc.strip().splitlines()[0])


@contextlib.contextmanager
def benchmark_process(group: str | None = None) -> Iterator[None]:
    """One thread for torch, and the process group ``group`` names: None (none), ``"one"``
    (gloo, this process alone: CPU DTensors without torchrun), ``"torchrun"`` (torchalpa's
    ``init_distributed``: torchrun's ranks, or this process alone when not under torchrun).
    The group is left when the block ends."""
    if group not in (None, "one", "torchrun"):
        raise ValueError(f"group {group!r}: expected None, 'one' or 'torchrun'")
    torch.set_num_threads(1)
    if group == "one":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif group == "torchrun":
        from torchalpa.runtime.execution.mesh import init_distributed
        init_distributed()
    try:
        yield
    finally:
        if group is not None and dist.is_initialized():
            dist.destroy_process_group()


def median_time(f: Callable[[], object], steps: int,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """The median seconds of ``steps`` calls of ``f`` on ``clock`` (``time.perf_counter``:
    wall time; ``time.thread_time``: this thread's CPU time)."""
    times = []
    for _ in range(steps):
        start = clock()
        f()
        times.append(clock() - start)
    return statistics.median(times)


def mark() -> tuple[float, float, int]:
    """Wall time, this thread's CPU time and this process's minor page faults so far."""
    return (time.perf_counter(), time.thread_time(),
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
