"""How ``AutoParallel``'s choice is written in a plan's notes, and read back: the one
definition the search (``parallel/auto.py``, the writer) and the views (the summary's
table of candidates, ``plan.explain_choice()``) share. The notes are plain text in the
plan file, as they always were:

    AutoParallel chose intra-op, remat=none: est 0.1108 s/step
    runner-up: intra-op, remat=full: est 0.1302 s/step
      tried: intra-op, remat=none, 2 micro-batches: not planned, only adds work to ...
      tried: pipeline, remat=none: est 0.2 s/step, 12.0 MiB per device (3.1 s)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CHOSEN", "RUNNER_UP", "TRIED", "Tried", "describe_candidate", "parse_tried",
           "is_choice_note"]

CHOSEN = "AutoParallel chose "
RUNNER_UP = "runner-up: "
TRIED = "  tried: "

_AGAIN = ", parameters gathered again in backward"
_DESCRIBED = re.compile(r"(?P<kind>[\w-]+), remat=(?P<remat>\w+)"
                        r"(?:, (?P<micro>\d+) micro-batches)?(?P<again>" + re.escape(_AGAIN)
                        + r")?: (?P<outcome>.*)$")
_ESTIMATE = re.compile(r"^est (?P<step>[0-9.eE+-]+) s/step")


def describe_candidate(kind: str, remat: str, num_micro_batches: int, regather: bool) -> str:
    """``intra-op, remat=full, 4 micro-batches, parameters gathered again in backward``."""
    micro = "" if num_micro_batches == 1 else f", {num_micro_batches} micro-batches"
    return f"{kind}, remat={remat}{micro}{_AGAIN if regather else ''}"


@dataclass(frozen=True)
class Tried:
    """A candidate the search tried, as its note says."""

    kind: str
    remat: str
    num_micro_batches: int
    regather: bool
    outcome: str                # what followed the description: an estimate or why not
    step_s: float | None        # its estimate where it was planned

    @property
    def family(self) -> str:
        """What the summary groups by: the kind and the checkpointing mode."""
        return f"{self.kind}, remat={self.remat}"


def parse_tried(text: str) -> Tried | None:
    """The candidate a note describes (a ``tried``, ``chose`` or ``runner-up`` note's text
    after its prefix), or None if it describes none."""
    m = _DESCRIBED.match(text)
    if m is None:
        return None
    outcome = m["outcome"]
    est = _ESTIMATE.match(outcome)
    return Tried(m["kind"], m["remat"], int(m["micro"] or 1), bool(m["again"]), outcome,
                 float(est["step"]) if est else None)


def is_choice_note(note: str) -> bool:
    return note.startswith((CHOSEN, RUNNER_UP, TRIED))
