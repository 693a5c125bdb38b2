"""The cyclic garbage collector paused over a burst of short-lived allocations.

Building one LP bound makes millions of small objects (strategy lists, cost tables, the
linear model's lists) that plain reference counting frees; almost none are in cycles.
The collector still counts them and runs its generations every so many allocations,
each run scanning everything made since planning began: on target a's bounds about a
tenth of the CPU. ``collector_paused`` turns it off for such a burst and back on after,
so the runs it skipped happen as one later. Nothing decides by when an object is freed,
so what runs under it computes the same results.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off inside the block (when it was on), on again after, nested blocks
    included: only the one that turned it off turns it back on."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
