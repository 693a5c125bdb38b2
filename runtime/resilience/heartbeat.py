"""Each rank's heartbeat thread: proof of life for its peers, and the way a job's failure
reaches a rank that nothing else can stop.

One daemon thread per process, started by the first ``FaultMonitor`` of a multi-rank job
whose store is a TCPStore, over a store client of its own (a client must not be shared
between threads). Every ``HEARTBEAT_S`` it

- counts up ``torchalpa/beat/<rank>``: a rank whose counter stopped and that did not leave
  is dead (``Heartbeat.stopped``) -- and only it: a rank blocked in a collective keeps
  beating, so it is never blamed for another's death;
- looks for ``torchalpa/job_failed``, written by a rank that has decided the job failed
  (``Heartbeat.announce_failure``: it is about to raise ``RankFailedError``). Its peers'
  collectives fail then too and they end with their own errors; but a rank hung in
  Python, or blocked in a call no error reaches (a receive that is never matched), would
  run on until something outside kills it -- and in a plain launch (no torchrun agent)
  nothing does. So when this rank is not handling a failure itself
  (``Heartbeat.handling``), once every other rank has left (or ``STOP_GRACE_S`` after it
  saw the failure), the thread prints the failure and where the main thread was to
  stderr, marks the rank as left and ends the process with exit status 1.

The keys are the TCPStore's own, not under the process group's prefix.

A rank handles a failure itself once its fault monitor diagnoses a failed collective, the
launcher stops it, or an uncaught exception ends its script.

At exit the thread is stopped and joined (``clean_exit``), then the rank is marked as
left: a thread caught inside a store call at the interpreter's teardown aborts a finished
process.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
import traceback

import torch.distributed as dist

from torchalpa.runtime.resilience import clean_exit

__all__ = ["Heartbeat", "HEARTBEAT_S", "STOP_GRACE_S", "failure_key"]

PREFIX = "torchalpa/"
HEARTBEAT_S = 0.5
STOP_GRACE_S = 30.0
JOB_FAILED = PREFIX + "job_failed"
STOP_JOIN_S = 15.0           # a beat in flight ends within the store client's timeout (10 s)


def failure_key(rank: int) -> str:
    """Where rank ``rank`` records its own error for the others."""
    return f"{PREFIX}failed/{rank}"


def _left_key(rank: int) -> str:
    return f"{PREFIX}left/{rank}"


def _beat_key(rank: int) -> str:
    return f"{PREFIX}beat/{rank}"


class Heartbeat:
    """The process's heartbeat thread and what its peers read of it (class-level state:
    one per process)."""

    handling = threading.Event()     # this process ends by its own error: leave it alone
    _thread: threading.Thread | None = None
    _address: tuple[str, int] | None = None
    _stop = threading.Event()

    @staticmethod
    def _client(address: tuple[str, int]):
        return dist.TCPStore(address[0], address[1], is_master=False,
                             timeout=datetime.timedelta(seconds=10), wait_for_workers=False)

    @classmethod
    def start(cls, store, rank: int, world_size: int) -> None:
        if cls._thread is not None and cls._thread.is_alive():
            return
        base = store
        while hasattr(base, "underlying_store"):
            base = base.underlying_store
        if not isinstance(base, dist.TCPStore):
            return                      # no heartbeats: dead ranks are found by roll call
        cls._address = (base.host, base.port)
        try:
            client = cls._client(cls._address)
            client.add(_beat_key(rank), 1)
        except Exception:  # the store is not reachable this way: no heartbeats
            cls._address = None
            return
        cls._stop.clear()
        cls._thread = threading.Thread(target=cls._run, args=(client, rank, world_size),
                                       name="torchalpa-heartbeat", daemon=True)
        cls._thread.start()
        clean_exit.stop_at_exit(lambda: cls._stop_and_leave(client, rank))

    @classmethod
    def _run(cls, client, rank: int, world_size: int) -> None:
        others = [_left_key(r) for r in range(world_size) if r != rank]
        failure_seen: float | None = None
        while not cls._stop.wait(HEARTBEAT_S):
            try:
                client.add(_beat_key(rank), 1)
                if cls.handling.is_set() or not client.check([JOB_FAILED]):
                    continue
                failure_seen = failure_seen or time.monotonic()
                if client.check(others) or time.monotonic() - failure_seen > STOP_GRACE_S:
                    cls._stop_process(client, rank, client.get(JOB_FAILED).decode(errors="replace"))
            except Exception:  # the store is gone: the job is over
                return

    @classmethod
    def _stop_process(cls, client, rank: int, failure: str) -> None:
        """End this process: the job failed and this rank, still running, cannot hear it."""
        if cls.handling.is_set():        # the main thread took it up meanwhile
            return
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(unknown)\n"
        print(f"RankFailedError: rank {rank}: stopped by torchalpa: the job failed ({failure}); "
              "this rank was still running where no error could reach it (hung, or waiting "
              "for something that will not come), so its process ends here with exit status "
              f"1. Its main thread was at:\n{where}", file=sys.stderr, end="", flush=True)
        try:
            client.set(_left_key(rank), "stopped: the job failed")
        except Exception:  # the store may be gone; the process ends either way
            pass
        os._exit(1)

    @classmethod
    def _stop_and_leave(cls, client, rank: int) -> None:
        """At exit: end the thread (no store call in flight at teardown), then leave."""
        cls._stop.set()
        if cls._thread is not None:
            cls._thread.join(STOP_JOIN_S)
        try:
            client.set(_left_key(rank), "exited")
        except Exception:  # the store may be gone already
            pass

    @classmethod
    def announce_failure(cls, message: str) -> None:
        """Tell every rank's heartbeat that the job failed, and why (best effort)."""
        if cls._address is None:
            return                        # no heartbeats to tell
        try:
            cls._client(cls._address).set(JOB_FAILED, message[:4000])
        except Exception:  # the store may be gone too: the local error still propagates
            pass

    @classmethod
    def left(cls, rank: int, why: str) -> None:
        if cls._address is not None:
            cls._client(cls._address).set(_left_key(rank), why)

    @classmethod
    def stopped(cls, world_size: int, me: int) -> list[int]:
        """Ranks whose heartbeat does not move for a few beats and that did not leave."""
        if cls._address is None:
            return []
        client = cls._client(cls._address)
        others = [r for r in range(world_size) if r != me]
        before = {r: client.add(_beat_key(r), 0) for r in others}
        time.sleep(5 * HEARTBEAT_S)
        after = {r: client.add(_beat_key(r), 0) for r in others}
        return [r for r in others if after[r] == before[r]
                and not client.check([_left_key(r)])]

    @classmethod
    def wait_until_left(cls, ranks: list[int], deadline: float) -> None:
        """Until every rank of ``ranks`` has left, or ``deadline`` (time.monotonic)."""
        if cls._address is None or not ranks:
            return
        try:
            client = cls._client(cls._address)
            while time.monotonic() < deadline:
                if client.check([_left_key(r) for r in ranks]):
                    return
                time.sleep(0.2)
        except Exception:  # the store is gone: nobody is left to wait for
            return
