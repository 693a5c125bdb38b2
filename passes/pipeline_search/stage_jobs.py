"""The pipeline search's workers: independent solves in forked processes, and the exact
stage solves that idle workers keep busy.

``fork_map`` runs independent jobs (every distinct layer on every view, the stages of the
final plan) in up to one forked process per core (``cpu_workers``). The function reaches
the workers by the fork, not by pickling, so a bound method of an object holding the
step's graph costs nothing to hand over; only the jobs and their results are pickled.

The stage DP (``passes/pipeline_search/stage_search.py``) works in rounds: run the DP, price
the stages it chose by their own ILP, run it again. A round waits for its slowest solve
(GPT-39B: the first stage, 8 micro-batches in flight, 11-18 s, memory-bound), while the
other worker, done with the short ones, sits idle; the next round then often asks for a
stage that could have been solved in that idle time (the same layers on another view,
once the first view's exact price came in higher).

``StageJobs`` runs the solves a round asks for (``solve``) and, while a worker would be
idle, solves what the caller guesses later rounds will ask for (``guess``). A guessed
solve is kept aside and only handed over when a round asks for that very stage, so the
search asks for, and gets, exactly what it would without guessing: guesses change how
long the search takes, never what it finds. A guess still running when a round needs its
worker is stopped (each job is its own forked process, so it can be). Without workers
(one, or JAX loaded: ``can_fork``) the solves run here, in
order, and nothing is guessed.

A worker first sets what it inherited apart from its garbage collector (``_inherited``):
its collections then scan only what its own jobs make, not the planning process's whole
heap (the step's graphs, every candidate's strategies and cached solves), whose every
object a full scan would also copy out of the pages the fork shares.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import pickle
import sys
import threading
import traceback
from collections.abc import Callable, Hashable, Iterable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from torchalpa.core.progress import left
from torchalpa.passes.sharding.ilp import clock_stops_elsewhere, clock_watch

__all__ = ["StageJobs", "can_fork", "cpu_workers", "fork_map"]

log = logging.getLogger("torchalpa.planner")


class StageJobs:
    """Solves ``run(args)`` for keyed jobs in up to ``workers`` forked processes.

    ``guess()`` (set by the caller; called while a worker is free) returns (key, args) of
    jobs a later ``solve`` is likely to ask for, best first. ``run`` must be a function
    of ``args`` alone (the forked child reads the state the caller had when it forked)."""

    def __init__(self, run: Callable[[Any], Any], workers: int):
        self.run = run
        self.workers = workers if workers > 1 and can_fork() else 1
        self.guess: Callable[[], Iterable[tuple[Any, Any]]] = lambda: ()
        # key -> (process, the end of its pipe we read, whether a round asked for it)
        self._running: dict[Hashable, tuple[Any, Any, bool]] = {}
        self._done: dict[Hashable, tuple[bool, Any]] = {}     # key -> (ok, result or error)
        self.on_result: Callable[[Any, Any], None] = lambda key, value: None
        self.guessed = 0           # guesses started
        self.guesses_used = 0      # guesses a round then asked for
        self.guesses_stopped = 0   # guesses stopped to free a worker

    def solve(self, jobs: list[tuple[Hashable, Any]]) -> list[Any]:
        """``run(args)`` of each (key, args) in ``jobs`` (distinct keys), in order: a guess
        already made for a key is used, one still running is waited for. ``on_result``
        sees each as it arrives."""
        if self.workers <= 1:
            out = []
            for key, args in jobs:
                left(f"{len(out)} of {len(jobs)} stage solves of this round done")
                out.append(self.run(args))
                self.on_result(key, out[-1])
            return out
        wanted = [key for key, _ in jobs]
        for key in wanted:
            if key in self._done:
                self.guesses_used += 1
            elif key in self._running:
                process, conn, _ = self._running[key]
                self._running[key] = (process, conn, True)    # no longer only a guess
                self.guesses_used += 1
        queue = [(key, args) for key, args in jobs
                 if key not in self._done and key not in self._running]
        for key in wanted:
            if key in self._done:
                self._hand_over(key)
        while not all(key in self._done for key in wanted):
            left(f"{sum(key in self._done for key in wanted)} of {len(wanted)} stage solves "
                 f"of this round done")
            while queue and (len(self._running) < self.workers or self._stop_a_guess()):
                self._start(*queue.pop(0), needed=True)
            if len(self._running) < self.workers:
                self._start_guesses()
            for key in self._collect():
                if key in wanted:
                    self._hand_over(key)
        return [self._done.pop(key)[1] for key in wanted]

    def _hand_over(self, key: Hashable) -> None:
        ok, value = self._done[key]
        if not ok:
            raise RuntimeError(f"a stage solve failed in its worker:\n{value}")
        value, stops = value
        clock_stops_elsewhere(stops)     # only solves a round used count (not guesses)
        self._done[key] = (ok, value)
        self.on_result(key, value)

    def close(self) -> None:
        """Stop every guess still running (the search is over)."""
        for process, conn, _ in self._running.values():
            process.kill()
            process.join()
            conn.close()
        self._running.clear()
        self._done.clear()

    def _start(self, key: Hashable, args: Any, needed: bool) -> None:
        mine, theirs = mp.Pipe(duplex=False)
        process = mp.get_context("fork").Process(target=_child, args=(self.run, args, theirs),
                                                 daemon=True)
        process.start()
        theirs.close()
        self._running[key] = (process, mine, needed)

    def _start_guesses(self) -> None:
        for key, args in self.guess():
            if len(self._running) >= self.workers:
                return
            if key not in self._done and key not in self._running:
                self._start(key, args, needed=False)
                self.guessed += 1

    def _stop_a_guess(self) -> bool:
        """Stop the guess started last, if one runs; whether one was stopped."""
        guesses = [key for key, (_, _, needed) in self._running.items() if not needed]
        if not guesses:
            return False
        process, conn, _ = self._running.pop(guesses[-1])
        process.kill()
        process.join()
        conn.close()
        self.guesses_stopped += 1
        return True

    def _collect(self) -> list[Hashable]:
        """Wait for at least one running job to finish, keep what each finished one sent
        (a failure too: raised only if a round asks for that job) and return their
        keys."""
        assert self._running, "nothing to wait for"
        by_conn: dict[Any, Hashable] = {conn: key for key, (_, conn, _) in self._running.items()}
        finished = []
        for ready in wait(list(by_conn)):
            key = by_conn[ready]
            process, conn, _ = self._running.pop(key)
            try:
                ok, value = conn.recv()
            except EOFError:
                ok, value = False, f"the worker solving {key} died (exit code " \
                                   f"{process.exitcode}) without a result"
            process.join()
            conn.close()
            self._done[key] = (ok, value)
            finished.append(key)
        return finished


def can_fork() -> bool:
    """Whether forking workers is safe here: not with JAX loaded (a JAX program planned
    through the StableHLO frontend): the child can deadlock on a lock one of XLA's threads
    held at the fork."""
    return "jax" not in sys.modules


def cpu_workers() -> int:
    """Processes for independent solves: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def fork_map(fn: Callable[[Any], Any], items: Sequence[Any], workers: int, *,
             unit: str = "solves") -> list[Any]:
    """``[fn(x) for x in items]``, in up to ``workers`` forked processes when there are
    several of each, each process taking the next item when done with one (so put the
    longest first). An item that raises makes this raise that exception (the first such
    item's, in order) once all are done. As results come, the step running says how many
    of the ``unit`` are done (``core.progress.left``): its heartbeat speaks while this
    process waits on the workers.

    Forking a process that runs JAX (a JAX program planned through the StableHLO
    frontend) can deadlock the child on a lock one of XLA's threads held (``can_fork``):
    with JAX loaded the items run here, one after another (slower, same results)."""
    if workers <= 1 or len(items) < 2 or not can_fork():
        here = []
        for x in items:
            left(f"{len(here)} of {len(items)} {unit} done")
            here.append(fn(x))
        return here
    context = mp.get_context("fork")
    tasks, results = context.SimpleQueue(), context.SimpleQueue()
    processes = [context.Process(target=_serve, args=(fn, tasks, results), daemon=True)
                 for _ in range(min(workers, len(items)))]
    for process in processes:
        process.start()
    # fed from a thread: a full task pipe must not stop this one from reading results
    feeder = threading.Thread(target=_feed, args=(tasks, items, len(processes)), daemon=True)
    feeder.start()
    out: list[Any] = [None] * len(items)
    failed: dict[int, BaseException] = {}
    for done in range(len(items)):
        left(f"{done} of {len(items)} {unit} done, in {len(processes)} processes")
        n, ok, value = _next_result(results, processes)
        if ok:
            out[n], stops = value
            clock_stops_elsewhere(stops)
        else:
            failed[n] = value
    feeder.join()
    for process in processes:
        process.join()
    if failed:
        raise failed[min(failed)]
    return out


def _next_result(results: Any, processes: list) -> tuple:
    """The next ``(n, ok, value)`` a ``fork_map`` worker sent, waking when one arrives or a
    worker ends: a worker that ended before all results came (killed for memory, crashed
    in native code) raises here, naming its exit code, instead of leaving this process
    waiting for a result that will never come."""
    while results.empty():
        ended = [p for p in processes if p.exitcode is not None]
        failed = [p.exitcode for p in ended if p.exitcode != 0]
        if failed or len(ended) == len(processes):
            if not results.empty():     # sent just before it ended
                break
            why = f"exit code {failed[0]}" + (" (killed: out of memory?)" if failed[0] == -9
                                              else "") if failed else "every worker ended"
            raise RuntimeError(f"a planning worker process ended without its result ({why}); "
                               f"plan again, or on a machine with more memory per core")
        wait([p.sentinel for p in processes if p.exitcode is None], timeout=0.2)
    return results.get()


def _feed(tasks: Any, items: Sequence[Any], num_workers: int) -> None:
    for n, item in enumerate(items):
        tasks.put((n, item))
    for _ in range(num_workers):
        tasks.put(None)          # one stop sign per worker


def _inherited() -> None:
    """Set every object a forked worker inherited apart from its collector (``gc.freeze``:
    one list move, no scan): the planning process made them and keeps them, so a
    collection in the worker could only free cycles among them, which the worker's end
    frees anyway; objects its jobs make are collected as before. When objects are
    collected decides nothing a solve returns, so results do not change."""
    gc.freeze()


def _serve(fn: Callable[[Any], Any], tasks: Any, results: Any) -> None:
    """A ``fork_map`` worker: ``fn`` of each task until the stop sign."""
    _inherited()
    while (task := tasks.get()) is not None:
        n, item = task
        try:
            with clock_watch() as stops:
                value = fn(item)
            results.put((n, True, (value, stops)))
        except BaseException as e:      # report it to the parent, which raises it
            try:
                pickle.dumps(e)
            except Exception:
                e = RuntimeError(f"a job failed in its worker:\n{traceback.format_exc()}")
            results.put((n, False, e))


def _child(run: Callable[[Any], Any], args: Any, conn: Connection) -> None:
    _inherited()
    try:
        with clock_watch() as stops:
            value = run(args)
        result = (True, (value, stops))
    except BaseException:      # report it to the parent, which raises it
        result = (False, traceback.format_exc())
    conn.send(result)
    conn.close()
