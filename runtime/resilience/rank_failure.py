"""How a job says that one of its ranks failed: the error every other rank raises, and the
message naming the ranks that failed or died (``faults`` and ``launcher_stop`` use both)."""

from __future__ import annotations

__all__ = ["RankFailedError", "describe_culprits"]


class RankFailedError(RuntimeError):
    """Another rank failed or stopped responding; the message names it."""


def describe_culprits(failed: dict[int, str], dead: list[int]) -> str:
    """The ranks ``FaultMonitor.culprits`` found, as a message (at least one is given)."""
    parts = [f"rank {r} failed with {text}" for r, text in failed.items()]
    if dead:
        parts.append(f"rank(s) {', '.join(map(str, dead))} died (the process stopped without "
                     "an error: killed by a signal, the out-of-memory killer, or a crash of "
                     "the interpreter)")
    return "; ".join(parts)
