"""Bytes a function allocates at its peak, on any device: CPU runs too.

``torch.cuda.max_memory_allocated`` says what a GPU step held at its peak; a CPU has no
such counter. The profiler, with ``profile_memory=True``, records every allocation and
free of PyTorch's allocators (CPU and CUDA alike) with its size and time: summing them in
order gives the bytes held at each point, and their maximum the peak that ``fn`` added
on top of what was allocated before it began. ``alive_at_peak`` says what held them: the
top-level op (or autograd node) under which each block still alive there was allocated.

The profiler records the frees of the thread it runs on, not those of gloo's worker
threads: while it records, each collective's tensors are left for this thread to free
(``settle``); else a tensor whose last reference gloo's thread dropped would count as
held to the end of ``fn``, on some ranks and runs (a race).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from torchalpa.runtime.measurement.settle import settling

__all__ = ["Allocated", "peak_allocated"]


@dataclass
class Allocated:
    """What ``fn`` allocated: ``peak`` bytes above what was allocated when it began,
    ``end`` still allocated when it returned, and who allocated the blocks alive at the
    peak (top-level op name -> bytes)."""

    peak: int
    end: int
    alive_at_peak: dict[str, int] = field(default_factory=dict)
    result: object = None


def _events(prof) -> list[tuple[int, int, int, str]]:
    """(time, bytes, pointer, top-level op) of every allocation (bytes > 0) and free."""
    from torch._C._profiler import _EventType
    found = []
    stack = [(e, e.name) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, top = stack.pop()
        stack.extend((child, top) for child in event.children)
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            found.append((event.start_time_ns, fields.alloc_size, fields.ptr, top))
    found.sort(key=lambda e: e[0])
    return found


def peak_allocated(fn: Callable[[], object]) -> Allocated:
    """Run ``fn()`` under the profiler and return its allocation peak (``Allocated``)."""
    from torch.profiler import ProfilerActivity, profile
    with settling(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = _events(prof)
    held = peak = last = 0
    for i, (_, nbytes, _, _) in enumerate(events):
        held += nbytes
        if held > peak:
            peak, last = held, i + 1
    alive: dict[int, tuple[int, str]] = {}
    for _, nbytes, ptr, top in events[:last]:
        if nbytes > 0:
            alive[ptr] = (nbytes, top)
        else:
            alive.pop(ptr, None)
    by_op: collections.Counter = collections.Counter()
    for nbytes, top in alive.values():
        by_op[top] += nbytes
    return Allocated(peak, held, dict(by_op.most_common()), result)
