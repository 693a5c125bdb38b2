"""``StageJobs``: the pipeline search's stage solves in forked workers, idle workers solving
guesses that a later round may ask for. A guess changes when a result is ready, never
which: asked for, its result is the job's; never asked for, it is dropped; still running
when a round needs its worker, it is stopped; failed, it raises only when asked for."""

from __future__ import annotations

import os
import signal
import time

import pytest

from torchalpa.passes.pipeline_search import stage_jobs
from torchalpa.passes.pipeline_search.stage_jobs import StageJobs

# another test may have loaded JAX in this process; these children only sleep
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")


@pytest.fixture(autouse=True)
def forking(monkeypatch):
    """Fork even where another test loaded JAX (these jobs only sleep)."""
    monkeypatch.setattr(stage_jobs, "can_fork", lambda: True)


def _work(args):
    """(args, the process that ran it), after ``seconds``; fails on "fail"."""
    name, seconds = args
    if name == "fail":
        raise ValueError("this job fails")
    time.sleep(seconds)
    return name, os.getpid()


def test_a_guess_made_while_a_worker_idles_answers_the_next_round():
    jobs = StageJobs(_work, workers=2)
    jobs.guess = lambda: [("later", ("later", 0.0))]
    try:
        [(name, pid)] = jobs.solve([("now", ("now", 0.5))])
        assert name == "now" and pid != os.getpid()
        assert jobs.guessed == 1
        jobs.guess = lambda: []
        assert jobs.solve([("later", ("later", 0.0))])[0][0] == "later"
        assert jobs.guesses_used == 1
    finally:
        jobs.close()


def test_a_guess_is_stopped_when_a_round_needs_its_worker():
    jobs = StageJobs(_work, workers=2)
    jobs.guess = lambda: [("slow guess", ("slow guess", 30.0))]
    start = time.perf_counter()
    try:
        jobs.solve([("a", ("a", 0.3))])          # the other worker starts the guess
        jobs.guess = lambda: []
        out = jobs.solve([("b", ("b", 0.1)), ("c", ("c", 0.1))])
        assert [name for name, _ in out] == ["b", "c"]
        assert jobs.guesses_stopped == 1 and jobs.guesses_used == 0
    finally:
        jobs.close()
    assert time.perf_counter() - start < 20     # not waiting for the 30 s guess


def test_a_failed_guess_raises_only_when_asked_for():
    jobs = StageJobs(_work, workers=2)
    jobs.guess = lambda: [("fail", ("fail", 0.0))]
    try:
        assert jobs.solve([("a", ("a", 0.3))])[0][0] == "a"
        jobs.guess = lambda: []
        with pytest.raises(RuntimeError, match="this job fails"):
            jobs.solve([("fail", ("fail", 0.0))])
    finally:
        jobs.close()


def test_one_worker_solves_here_in_order_and_guesses_nothing():
    """One worker (or JAX loaded): the jobs run in this process, in order."""
    jobs = StageJobs(_work, workers=1)
    jobs.guess = lambda: pytest.fail("no guesses without workers")
    seen = []
    jobs.on_result = lambda key, value: seen.append(key)
    out = jobs.solve([("x", ("x", 0.0)), ("y", ("y", 0.0))])
    assert [name for name, _ in out] == ["x", "y"] and seen == ["x", "y"]
    assert all(pid == os.getpid() for _, pid in out)


def _stopped_by_the_clock(seconds):
    """What a solver run stopped by its time limit of ``seconds`` records (``solve_ilp``)."""
    from torchalpa.passes.sharding import ilp
    stops = ilp._clock_stops.get()
    assert stops is not None, "the worker watches for clock stops"
    stops.append(float(seconds))
    return os.getpid()


def test_clock_stops_in_forked_workers_reach_the_callers_watch():
    """A time limit that fires in a forked solve is counted where the search watches (the
    plan's notes say so), for ``fork_map``'s workers and for the rounds' solves; a guess
    no round asked for is not counted."""
    from torchalpa.passes.sharding.ilp import clock_watch
    with clock_watch() as stops:
        pids = stage_jobs.fork_map(_stopped_by_the_clock, [1, 2, 3], workers=2)
    assert os.getpid() not in pids and sorted(stops) == [1.0, 2.0, 3.0]
    jobs = StageJobs(_stopped_by_the_clock, workers=2)
    jobs.guess = lambda: [("never asked", 9)]
    try:
        with clock_watch() as stops:
            [pid] = jobs.solve([("asked", 4)])
    finally:
        jobs.close()
    assert pid != os.getpid() and stops == [4.0]


def _killed_at_two(x):
    """A fork_map item whose worker is killed (as the kernel kills a process for memory)."""
    if x == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def test_a_worker_killed_mid_item_raises_instead_of_hanging():
    """``fork_map`` waits for a result or a worker's end: a worker killed before it sent
    its item's result makes the call raise, naming the exit code, where waiting on the
    results alone would wait forever."""
    with pytest.raises(RuntimeError, match=r"exit code -9 \(killed"):
        stage_jobs.fork_map(_killed_at_two, [1, 2, 3, 4], workers=2)


def _frozen(_):
    """How many objects this process's collector has set apart (``gc.freeze``)."""
    import gc
    return gc.get_freeze_count()


def test_a_worker_sets_what_it_inherited_apart_from_its_collector_and_the_caller_does_not():
    """Both kinds of worker (``fork_map``'s and ``StageJobs``') freeze the objects the
    fork gave them, so their collections scan only what their jobs make; the planning
    process's own collector is left as it was."""
    import gc
    before = gc.get_freeze_count()
    tracked = len(gc.get_objects())
    assert stage_jobs.fork_map(_frozen, [1, 2], workers=2) == [pytest.approx(tracked, rel=0.5)] * 2
    jobs = StageJobs(_frozen, workers=2)
    try:
        [inherited] = jobs.solve([("a", None)])
    finally:
        jobs.close()
    assert inherited >= 0.5 * tracked
    assert gc.get_freeze_count() == before
