"""runtime/measurement/settle.py: while ``peak_allocated`` records, a tensor whose last
holder is another thread (gloo's work on its worker thread) is freed on the measuring
thread, so its free is recorded.

A thread here plays gloo's worker: it takes a view of the collective's input (as gloo's
work holds the tensors it was handed) and drops it a little later, after the caller has
dropped its own reference. Without ``settle`` that thread frees the block, the profiler
misses the free, and the measured allocation stays counted to the end."""

from __future__ import annotations

import threading
import time

import torch

from torchalpa.runtime.measurement import settle
from torchalpa.runtime.measurement.allocated import peak_allocated

NUMEL = 1 << 20          # 4 MiB of float32


def _collective_on_a_worker(with_settle: bool) -> None:
    """An input made for a 'collective' whose work (a worker thread) holds it past the
    caller's own reference, then the 'result' waited for."""
    x = torch.ones(NUMEL)
    before = settle.uses_before(x)
    held = [x.view(-1)]           # the work's reference
    result = torch.zeros(1)
    settle.track(x, before, result)
    released = threading.Event()

    def work():
        time.sleep(0.02)
        held.clear()                # the worker drops the input: freed here if it is the last
        released.set()

    worker = threading.Thread(target=work)
    worker.start()
    del x                           # the caller drops its reference before the work is done
    if with_settle:
        settle.settle(result)       # the finish half, after its wait
    released.wait()
    worker.join()


def test_a_block_the_worker_held_last_is_freed_where_it_is_recorded():
    measured = peak_allocated(lambda: _collective_on_a_worker(with_settle=True))
    assert measured.end < NUMEL * 4 // 2, measured          # the 4 MiB input's free recorded
    assert measured.peak >= NUMEL * 4, measured             # and it was counted while held


def test_without_settle_the_worker_frees_the_block_unrecorded():
    """What the measurement read before: the input counted as held at the end."""
    measured = peak_allocated(lambda: _collective_on_a_worker(with_settle=False))
    assert measured.end >= NUMEL * 4, measured


def test_an_input_the_work_let_go_of_is_dropped_at_the_next_op():
    """Between collectives (the wait far later), the input goes when the work lets go of
    it, at the first op after: not held until the wait."""
    def step():
        x = torch.ones(NUMEL)
        result = settle.track(x, settle.uses_before(x), torch.zeros(1))
        del x                       # no work holds it: it goes at the next op
        y = torch.ones(NUMEL)       # allocated after the input's free
        settle.settle(result)
        return y.sum()

    measured = peak_allocated(step)
    assert measured.peak < 2 * NUMEL * 4, measured


def test_off_outside_a_measurement():
    x = torch.ones(4)
    assert settle.uses_before(x) is None
    result = torch.zeros(1)
    assert settle.track(x, None, result) is result
    assert not settle._HELD
