"""Under torchrun, a survivor says which rank died before the agent's SIGTERM ends it.

When one worker dies, torchrun's agent stops the others with SIGTERM (then SIGKILL after
30 s). By default that ends a survivor silently, wherever it was -- usually blocked in a
collective waiting for the dead rank -- so the only account of the failure is the agent's
summary. This module gives every survivor a last word:

- a SIGTERM handler is installed (only under torchrun, only from the main thread, only
  where no one else handles SIGTERM or owns the signal wakeup fd);
- the signal also reaches a watcher thread through ``signal.set_wakeup_fd``, so it is
  handled even while the main thread is blocked inside a collective (where Python
  handlers cannot run);
- the watcher diagnoses with the fault monitor's records and heartbeats
  (``FaultMonitor.culprits``): a rank that raised is named with its error, a rank whose
  heartbeat stopped without leaving is named as dead, and this rank marks itself as
  leaving so that slower survivors never blame it;
- if the main thread is running Python, the handler raises ``RankFailedError`` with that
  message there (the script's own error handling and ``atexit`` run); otherwise, after a
  short wait, the watcher prints the message to stderr and ends the process (exit code
  1), as SIGTERM would have ended it anyway.

A SIGTERM with no rank at fault (a scheduler stopping the job) ends the process as the
default action does (exit status 143), after the diagnosis found no culprit.

A process forked from the rank (the planner's stage-solving workers, a
``multiprocessing`` pool) starts with SIGTERM's default action and no wakeup fd: it would
otherwise inherit both, and the SIGTERM that stops such a worker (``Pool.terminate``)
would be written into the rank's own wakeup pipe and end the rank.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from torchalpa.runtime.resilience import clean_exit
from torchalpa.runtime.resilience.heartbeat import Heartbeat
from torchalpa.runtime.resilience.rank_failure import RankFailedError, describe_culprits

__all__ = ["install"]

_LAUNCHER_ENV = "TORCHELASTIC_RUN_ID"
MAIN_THREAD_GRACE_S = 2.0


class _Stop:
    """The state shared by the SIGTERM handler (main thread) and the watcher thread."""

    def __init__(self, monitor):
        self.monitor = monitor
        self.message: str | None = None      # None: no rank at fault
        self.diagnosed = threading.Event()
        self.taken = threading.Event()       # the main thread raised the message itself

    def diagnose(self) -> None:
        """Who made the launcher stop this rank (the heartbeats need ~2.5 s to tell)."""
        Heartbeat.handling.set()          # this rank ends here, with this diagnosis
        monitor = self.monitor
        try:
            failed, dead = monitor.culprits()
        except Exception as e:  # the agent's store is gone: nothing more can be known
            failed, dead = {}, []
            self.message = (f"rank {monitor.rank}: torchrun stopped the job (SIGTERM) and its "
                            f"store is unreachable ({type(e).__name__}); see the agent's "
                            "report for the rank that failed")
        monitor.leaving(failed, dead)
        if failed or dead:
            self.message = (f"rank {monitor.rank}: torchrun stopped the job (SIGTERM) "
                            f"because {describe_culprits(failed, dead)}")
        self.diagnosed.set()

    def on_signal(self, signum, frame) -> None:
        """The Python-level handler: runs when the main thread executes Python."""
        self.diagnosed.wait(timeout=30)
        self.taken.set()
        if self.message is not None:
            raise RankFailedError(self.message)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def watch(self, wakeup_fd: int) -> None:
        """The watcher thread: wakes on SIGTERM even while the main thread is blocked."""
        while True:
            try:
                received = os.read(wakeup_fd, 64)
            except OSError:
                return
            if not received:              # the pipe was closed: the process is exiting
                return
            if signal.SIGTERM.value in received:
                break
        self.diagnose()
        if self.taken.wait(MAIN_THREAD_GRACE_S):
            return
        if self.message is None:
            os._exit(128 + signal.SIGTERM.value)
        print(f"RankFailedError: {self.message}", file=sys.stderr, flush=True)
        os._exit(1)


_installed: _Stop | None = None


def _forget_in_child() -> None:
    """In a process forked from this rank: SIGTERM's default action, no wakeup fd (the
    watcher thread is not forked; the pipe it reads is the rank's)."""
    global _installed
    _installed = None
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:    # the signal module refuses outside the main thread: nothing to reset
        pass


def install(monitor) -> bool:
    """Give this rank a last word when torchrun stops it (see the module docstring);
    whether it was installed. Once per process; a no-op outside torchrun."""
    global _installed
    if _installed is not None:
        return True
    if not os.environ.get(_LAUNCHER_ENV) or threading.current_thread() is not \
            threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        previous = None
    if previous != -1:                   # another owner of the wakeup fd: leave it alone
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return False
    stop = _Stop(monitor)
    signal.signal(signal.SIGTERM, stop.on_signal)
    os.register_at_fork(after_in_child=_forget_in_child)
    watcher = threading.Thread(target=stop.watch, args=(read_fd,), name="torchalpa-sigterm",
                               daemon=True)
    watcher.start()
    clean_exit.stop_at_exit(lambda: _uninstall(watcher, write_fd))
    _installed = stop
    return True


def _uninstall(watcher: threading.Thread, write_fd: int) -> None:
    """At exit: SIGTERM acts by default again, and the watcher thread ends (its pipe is
    closed) before the interpreter's teardown."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return                            # signals can be reset from the main thread only
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    os.close(write_fd)
    watcher.join(1.0)
    _installed = None
