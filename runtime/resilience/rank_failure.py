"""How a job says that one of its ranks failed: the error every other rank raises, and the
message naming the ranks that failed or died (``faults`` and ``launcher_stop`` use both)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["RankFailedError", "describe_culprits"]


class RankFailedError(RuntimeError):
    """Another rank failed or stopped responding; the message names it."""


def describe_culprits(failed: dict[int, str], dead: list[int],
                      stuck: Sequence[int] = ()) -> str:
    """The ranks ``FaultMonitor.culprits`` found, as a message (at least one is given).
    ``stuck``: those of ``dead`` whose process is alive (``Heartbeat.stuck``)."""
    parts = [f"rank {r} failed with {text}" for r, text in failed.items()]
    dead = [r for r in dead if r not in stuck]
    if stuck:
        parts.append(f"rank(s) {', '.join(map(str, stuck))} are stuck (alive, but no Python "
                     "runs in the process, not even its heartbeat thread: a C call holding "
                     "the GIL, such as a C extension's loop or a ctypes.PyDLL call; its "
                     "watchdog stops it once the job has failed)")
    if dead:
        parts.append(f"rank(s) {', '.join(map(str, dead))} died (the process stopped without "
                     "an error: killed by a signal, the out-of-memory killer, or a crash of "
                     "the interpreter)")
    return "; ".join(parts)
