"""A rank's watchdog: a small process that stops the rank when the job failed and the rank
is stuck where no Python runs -- not even its heartbeat thread.

The heartbeat thread (``heartbeat``) stops a rank that is hung in Python or blocked in a
call that releases the GIL. It cannot stop a rank whose main thread holds the GIL inside
C code (a C extension's loop, a ``ctypes.PyDLL`` call): no thread of that interpreter
runs again. So each rank of a multi-rank job starts this script as a child process
(``python rank_watchdog.py HOST PORT RANK WORLD PID``) and its heartbeat thread writes a
byte to the child's stdin every beat ("." alive, "q" leaving). The watchdog

- ends itself when the rank ends (its stdin closes, it gets "q", or its parent changes);
- while the beats come, does nothing else: it imports only the standard library;
- once no beat came for ``SILENT_S`` while the rank's process is alive, imports torch and
  connects to the job's store: it marks the rank as stuck (``torchalpa/stuck/<rank>``,
  which its peers' error messages read), and if the job failed (``torchalpa/job_failed``)
  and every other rank has left, or ``STOP_GRACE_S`` after it saw the failure, it stops
  the rank from outside: a signal that makes ``faulthandler`` print where each thread
  was (``DUMP_SIGNAL``, when the rank registered it), its own message on stderr, the
  rank marked as left, then SIGTERM and, if that does not end it, SIGKILL.

A rank whose beats come back is unmarked. Nothing of torchalpa is imported here (the
package imports torch); this file's directory is removed from ``sys.path`` first, since
it holds modules named as the standard library's.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import datetime  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

SILENT_S = 2.0            # no beat for this long (4 beats): the rank's interpreter is stuck
STOP_GRACE_S = 30.0       # as heartbeat.STOP_GRACE_S
TERM_WAIT_S = 3.0         # after SIGTERM, before SIGKILL
DUMP_SIGNAL = signal.SIGUSR2
PREFIX = "torchalpa/"     # the keys of heartbeat.py
JOB_FAILED = PREFIX + "job_failed"


def stuck_key(rank: int) -> str:
    return f"{PREFIX}stuck/{rank}"


def _left_key(rank: int) -> str:
    return f"{PREFIX}left/{rank}"


class Watch:
    def __init__(self, host: str, port: int, rank: int, world: int, pid: int):
        self.host, self.port, self.rank, self.world, self.pid = host, port, rank, world, pid
        self.last_beat = time.monotonic()
        self.store = None
        self.marked = False
        self.failure_seen: float | None = None

    def rank_alive(self) -> bool:
        return os.getppid() == self.pid

    def connect(self):
        if self.store is None:
            # only now: until its rank falls silent, a watchdog costs a bare interpreter.
            # c10d's own log quiet: a store gone with its job (a rank slow to tear down
            # under load reads as silent) would print its client's retries and backtraces
            # on the rank's stderr after the job ended; what this process has to say, it
            # prints itself
            os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
            import torch.distributed as dist
            self.store = dist.TCPStore(self.host, self.port, is_master=False,
                                       timeout=datetime.timedelta(seconds=5),
                                       wait_for_workers=False)
        return self.store

    def heard(self, data: bytes) -> bool:
        """A beat arrived; False when the rank said it is leaving."""
        if b"q" in data:
            return False
        self.last_beat = time.monotonic()
        self.failure_seen = None
        if self.marked and self.store is not None:
            try:
                self.store.delete_key(stuck_key(self.rank))
            except Exception:  # the store is gone: nobody reads the mark any more
                pass
            self.marked = False
        return True

    def silent(self) -> bool:
        """The rank is silent: mark it, and stop it if the job failed (True: stopped)."""
        silent_s = time.monotonic() - self.last_beat
        store = self.connect()
        if not self.marked:
            store.set(stuck_key(self.rank), f"no Python ran in its process for {silent_s:.0f} s")
            self.marked = True
        if not store.check([JOB_FAILED]):
            return False
        self.failure_seen = self.failure_seen or time.monotonic()
        others = [_left_key(r) for r in range(self.world) if r != self.rank]
        if not store.check(others) and time.monotonic() - self.failure_seen < STOP_GRACE_S:
            return False
        self.stop(store.get(JOB_FAILED).decode(errors="replace"), silent_s)
        return True

    def stop(self, failure: str, silent_s: float) -> None:
        try:
            os.kill(self.pid, DUMP_SIGNAL)        # faulthandler: where its threads are
            time.sleep(0.5)
        except OSError:
            return
        print(f"RankFailedError: rank {self.rank}: stopped by torchalpa: the job failed "
              f"({failure}); this rank was stuck where no Python ran for {silent_s:.0f} s, "
              "not even its heartbeat thread (a C call holding the GIL: a C extension's "
              "loop, a ctypes.PyDLL call), so its watchdog process ends it (SIGTERM, then "
              "SIGKILL). Its threads were where the traceback above shows.",
              file=sys.stderr, flush=True)
        try:
            assert self.store is not None, "stop() follows connect()"
            self.store.set(_left_key(self.rank), "stopped: stuck after the job failed")
        except Exception:  # the store may be gone; the rank is stopped either way
            pass
        for sig, wait_s in ((signal.SIGTERM, TERM_WAIT_S), (signal.SIGKILL, 0.0)):
            try:
                os.kill(self.pid, sig)
            except OSError:
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and self.rank_alive():
                time.sleep(0.05)
            if not self.rank_alive():
                return


def main() -> None:
    host, port, rank, world, pid = sys.argv[1], *map(int, sys.argv[2:6])
    watch = Watch(host, port, rank, world, pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C is for the rank, not for us
    fd = sys.stdin.fileno()
    while watch.rank_alive():
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            data = os.read(fd, 4096)
            if not data or not watch.heard(data):
                return
            continue
        if time.monotonic() - watch.last_beat < SILENT_S:
            continue
        try:
            if watch.silent():
                return
        except ImportError:  # no torch here: nothing this watchdog can do
            return
        except Exception:  # the store is unreachable (for now): try again
            time.sleep(1.0)


if __name__ == "__main__":
    main()
