"""A process that used torchalpa ends with its script's own exit status, however the script
ends: ``torchalpa.shutdown()``, ``dist.destroy_process_group()``, or nothing at all.

The danger is the interpreter's teardown. A thread that is inside a C++ call when teardown
begins (a store request, a gloo worker freeing the last collective's tensors) dies there
when it next takes the GIL, by ``pthread_exit`` through C++ frames: "terminate called
without an active exception", SIGABRT, after the job's work is done -- and torchrun
reports the job as failed. On a loaded machine the heartbeat's store request (one every
``heartbeat.HEARTBEAT_S``) was caught so (pytorch/pytorch#179291 describes the gloo case).

So at interpreter exit (one ``atexit`` handler, registered when torchalpa first sets up
distributed work: ``mesh.init_distributed`` or a ``ParallelModule``'s fault monitor), while
the interpreter is still whole:

1. torchalpa's own threads are stopped and joined, the last started first (the SIGTERM
   watcher of ``launcher_stop``, then the heartbeat, which then marks the rank as left);
2. the process group is left (``destroy_process_group``) if it is still up, as
   ``torchalpa.shutdown()`` does -- unless the script is ending with an uncaught
   exception (``ending_with_error``), when peers may still be waiting on this rank;
3. gloo's worker threads are given a moment (at most ``GLOO_IDLE_WAIT_S``) to finish
   with their last work: until none of them is running (Linux; read from /proc).

Nothing here calls ``os._exit``: the exit status stays the script's (``sys.exit(n)``,
1 after an uncaught exception). ``torchalpa.shutdown()`` remains the explicit form, which
also skips the teardown itself. Being registered when torchalpa is first used, the handler
runs before the ``atexit`` handlers registered earlier (torch's own, at import) and after
those a script registers later (which may still use the process group).
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["install", "stop_at_exit", "ending_with_error", "GLOO_IDLE_WAIT_S"]

GLOO_IDLE_WAIT_S = 1.0
_GLOO_WORKER = "pt_gloo_runloop"      # the name gloo's ProcessGroup gives its worker threads

_stops: list[Callable[[], None]] = []
_installed = False
_ending_with_error = False


def install() -> None:
    """Register the exit handler (once per process)."""
    global _installed
    if not _installed:
        atexit.register(_at_exit)
        _installed = True


def stop_at_exit(stop: Callable[[], None]) -> None:
    """Have ``stop`` (the orderly end of one of torchalpa's threads) run at exit, before the
    process group is left; the last registered runs first."""
    _stops.append(stop)
    install()


def ending_with_error() -> None:
    """The script is ending with an uncaught exception (called from ``sys.excepthook``)."""
    global _ending_with_error
    _ending_with_error = True


def _at_exit() -> None:
    while _stops:
        stop = _stops.pop()
        try:
            stop()
        except Exception:  # a thread that cannot be stopped cleanly must not block the exit
            pass
    if dist.is_available() and dist.is_initialized() and not _ending_with_error:
        try:
            dist.destroy_process_group()
        except Exception:  # already half torn down: the exit goes on
            pass
    _wait_for_idle_gloo_workers(GLOO_IDLE_WAIT_S)


def _running_gloo_workers() -> int | None:
    """How many of gloo's worker threads are running or ready to run (None: unknown here)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    running = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != _GLOO_WORKER:
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):   # the thread ended meanwhile
            continue
        running += state == "R"
    return running


def _wait_for_idle_gloo_workers(limit_s: float) -> None:
    """Until no gloo worker thread has run for two looks 5 ms apart (the GIL released
    between them, for one that needs it to free a tensor), or ``limit_s``."""
    deadline = time.monotonic() + limit_s
    idle_looks = 0
    while idle_looks < 2 and time.monotonic() < deadline:
        running = _running_gloo_workers()
        if running is None:
            return
        idle_looks = idle_looks + 1 if running == 0 else 0
        time.sleep(0.005)
