"""A collective's tensors freed on the calling thread while memory is measured.

``allocated.peak_allocated`` sums the allocations and frees the profiler records. The
profiler records those of the thread that runs it (and of the threads that inherit its
state, autograd's), not those of the process group's own threads. Gloo runs each
collective on a worker thread, and the work object it hands that thread holds the
collective's input and output until the thread drops it, just after the collective is
done. When the caller has already dropped its own references by then (an input made for
the collective alone, a gathered weight read by one matmul), the last reference is the
worker's and the tensor is freed there: the memory is returned at once, but no free is
recorded, and the measured peak counts the block until the step's end. Which thread
drops last is a race, so the same step measured more on one rank or one run than on
another (up to 84 MB on the wide MLP under ZeRO-3).

While ``settling()`` is on, each issue half of ``runtime.execution.collectives`` hands its
input and result to ``track``, which notes who holds each (the tensors sharing its
storage, the references to the tensor itself), and keeps a reference to the input. That
reference is dropped, on the caller's thread, once the work lets go of the input: checked
before every op (a dispatch mode) and every collective, so a tensor the caller no longer
reads is freed at the first op after gloo is done with it, about where gloo's thread frees
it in a step not measured. Each finish half calls ``settle`` after its wait: it waits
(at most ``_SETTLE_S``) until the work holds neither the input nor the result, so what
the caller drops afterwards is freed by the caller. Off (the default, and always under
``torch.compile``), both are a flag test: a training step is unchanged.

Not covered: gloo's own buffers (the copy it reduces or gathers in), which it allocates
and frees itself; a block of those freed on its thread is still missed (seen after a
step's peak, at its last bucket).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["settling", "uses_before", "track", "settle"]

_ON = False


@dataclass(slots=True)
class _Issued:
    """A collective in flight: its input (None once let go), held as ``input_uses`` says
    when it was issued, and its result, the caller's alone (``result_uses``: one tensor,
    one reference; or the input's for an in-place collective)."""

    input: torch.Tensor | None
    input_uses: tuple[int, int]
    result: torch.Tensor
    result_uses: tuple[int, int]

    def input_released(self) -> bool:
        return self.input is None or _within(_uses(self.input), self.input_uses)

    def released(self) -> bool:
        return self.input_released() and _within(_uses(self.result), self.result_uses)


_HELD: dict[int, _Issued] = {}     # id(result) -> its collective
_SETTLE_S = 0.05   # at most this long per collective (then what holds it is not gloo's work)


def _uses(t: torch.Tensor) -> tuple[int, int]:
    """Who holds ``t``: the tensors sharing its storage (each view holds it once), and
    the references to ``t`` itself (gloo's work keeps the tensors it was handed)."""
    storage = torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1
    return storage, t._use_count()  # pyright: ignore[reportAttributeAccessIssue]


def _within(now: tuple[int, int], then: tuple[int, int]) -> bool:
    return now[0] <= then[0] and now[1] <= then[1]


class _SweepEachOp(TorchDispatchMode):
    """Drop the inputs gloo has let go of before each op runs: so a tensor is freed at the
    first op after its collective is done, where gloo's thread frees it outside a
    measurement, not at the next collective."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _HELD:
            _sweep()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def settling() -> Iterator[None]:
    """Collectives issued inside wait, after their own wait, for the process group's
    thread to drop their tensors (module doc)."""
    global _ON
    previous, _ON = _ON, True
    try:
        with _SweepEachOp():
            yield
    finally:
        _ON = previous
        if not previous:
            _HELD.clear()


def uses_before(x: torch.Tensor) -> tuple[int, int] | None:
    """Who holds ``x`` before it is handed to a collective (None: not settling).
    Inputs of collectives issued earlier whose work has let go are dropped first."""
    if not _ON or torch.compiler.is_compiling():
        return None
    _sweep()
    return _uses(x)


def track(x: torch.Tensor, before: tuple[int, int] | None, result: torch.Tensor
          ) -> torch.Tensor:
    """Remember ``x`` (the collective's input, held as ``before`` says when it was issued)
    until the work of ``result``'s collective lets go of it; returns ``result``."""
    if before is not None:
        _HELD[id(result)] = _Issued(x, before, result, (1, 1) if result is not x else before)
    return result


def _sweep() -> None:
    """Drop the inputs whose collective's work let go of them: one the caller dropped is
    freed now, on this thread, near where gloo's thread would have freed it (a
    collective's input is held until the collective is done, not until its wait)."""
    for issued in _HELD.values():
        if issued.input is not None and issued.input_released():
            issued.input = None


def settle(result: torch.Tensor) -> None:
    """After the wait for ``result``: wait until the collective's work holds neither its
    input nor ``result``, then let go of the input here, on the caller's thread."""
    if not _HELD or torch.compiler.is_compiling():
        return
    issued = _HELD.pop(id(result), None)
    if issued is not None:
        deadline = time.perf_counter() + _SETTLE_S
        while not issued.released() and time.perf_counter() < deadline:
            time.sleep(0.0001)
        del issued
    _sweep()
