"""Failures that reach every rank: a rank that raises or stops, inputs that differ.

In SPMD training one rank's failure leaves the others waiting in a collective. torchalpa
turns that into an error on every rank that names the rank at fault:

- a rank whose step raises, or whose script dies of an uncaught exception, writes
  ``rank r: <error>`` into the job's key-value store (the one ``torch.distributed`` was
  initialized with) before it exits;
- a rank whose collective fails -- the peer's connection closed, or nothing arrived within
  the collective timeout (``TORCHALPA_TIMEOUT_S``) -- reads those records and raises
  ``RankFailedError`` naming the failed rank and its error. Without a record (a rank killed
  by a signal, or one stuck outside torchalpa) the waiting ranks take a roll call in the
  store; ranks that do not answer within a grace period are named as not responding.

Input shapes are compared across ranks on the first call (one small all-gather), so a rank
fed a different batch shape is named on every rank at once instead of after a timeout.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["RankFailedError", "FaultMonitor", "check_same_inputs", "describe_specs"]

_PREFIX = "torchalpa/"
_COMM_ERROR_HINTS = ("gloo", "Connection closed", "Connection reset", "Timed out", "timed out",
                     "NCCL", "Broken pipe", "Socket", "socket")


class RankFailedError(RuntimeError):
    """Another rank failed or stopped responding; the message names it."""


def _is_comm_error(e: BaseException) -> bool:
    kinds = tuple(k for k in (getattr(dist, "DistError", None),) if k is not None)
    if kinds and isinstance(e, kinds):
        return True
    return isinstance(e, RuntimeError) and any(h in str(e) for h in _COMM_ERROR_HINTS)


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no process group, or a launcher without a store
        return None


class FaultMonitor:
    """Records this rank's failures and diagnoses its peers' (one per process group)."""

    _hook_installed = False

    def __init__(self, timeout_s: float):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout_s = float(timeout_s)
        self.store = _default_store() if self.world_size > 1 else None
        if self.store is not None:
            self._install_excepthook()

    # -- this rank ----------------------------------------------------------------------
    def record(self, error: BaseException) -> None:
        """Tell the other ranks that this one failed, and why (best effort)."""
        if self.store is None or isinstance(error, RankFailedError):
            return
        text = f"{type(error).__name__}: {error}".strip()
        try:
            self.store.set(f"{_PREFIX}failed/{self.rank}", text[:2000])
        except Exception:  # the store may be gone too; the local error still propagates
            pass

    def _install_excepthook(self) -> None:
        if FaultMonitor._hook_installed:
            return
        previous = sys.excepthook

        def hook(kind, value, tb):
            self.record(value)
            previous(kind, value, tb)

        sys.excepthook = hook
        FaultMonitor._hook_installed = True

    @contextlib.contextmanager
    def guard(self, what: str):
        """Around work that issues collectives: local errors are recorded for the peers;
        a failed collective becomes a ``RankFailedError`` naming the rank at fault."""
        try:
            yield
        except RankFailedError:
            raise
        except Exception as e:
            if self.store is not None and _is_comm_error(e):
                raise RankFailedError(self.diagnose(what, e)) from e
            self.record(e)
            raise

    # -- the other ranks ----------------------------------------------------------------
    def diagnose(self, what: str, error: BaseException) -> str:
        """Which rank made this rank's collective fail, as a message for the user."""
        me = f"rank {self.rank}: {what} stopped because "
        first_line = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        tail = (f"\n(the collective error on rank {self.rank}: {type(error).__name__}: "
                f"{first_line})")
        try:
            failed = self._failures()
            if failed:
                who = "; ".join(f"rank {r} failed with {text}" for r, text in failed.items())
                return me + who + tail
            missing = self._roll_call()
        except Exception as e:  # the store lives on rank 0 or in the launcher
            return (me + "a peer stopped responding and the job's store is unreachable "
                    f"({type(e).__name__}); the store's host (rank 0 or the launcher) has "
                    "probably failed" + tail)
        if missing:
            ranks = ", ".join(map(str, missing))
            return (me + f"rank(s) {ranks} did not respond (dead, hung, or no longer calling "
                    f"the model; collective timeout {self.timeout_s:g} s, set by "
                    "TORCHALPA_TIMEOUT_S)" + tail)
        return me + "a collective failed on every rank; see the error below" + tail

    def _failures(self) -> dict[int, str]:
        out = {}
        for r in range(self.world_size):
            key = f"{_PREFIX}failed/{r}"
            if r != self.rank and self.store.check([key]):
                out[r] = self.store.get(key).decode(errors="replace")
        return out

    def _roll_call(self) -> list[int]:
        """Ranks that do not report within a grace period after this one failed."""
        self.store.set(f"{_PREFIX}alive/{self.rank}", "1")
        grace = min(10.0, max(2.0, 0.25 * self.timeout_s))
        deadline = time.monotonic() + grace
        others = [r for r in range(self.world_size) if r != self.rank]
        while True:
            missing = [r for r in others if not self.store.check([f"{_PREFIX}alive/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            if self._failures():
                return missing
            time.sleep(0.2)


def describe_specs(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> str:
    return "[" + ", ".join(f"{tuple(s)} {str(d).removeprefix('torch.')}" for s, d in specs) + "]"


def check_same_inputs(specs: list[tuple[tuple[int, ...], torch.dtype]], expected: str) -> None:
    """Every rank passes inputs of the same shapes and dtypes, or every rank raises a
    ValueError naming the ranks that differ (one all-gather of the shapes)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = [(tuple(s), str(d)) for s, d in specs]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if all(e == everyone[0] for e in everyone):
        return
    groups: dict[str, list[int]] = {}
    for r, e in enumerate(everyone):
        text = "[" + ", ".join(f"{s} {d.removeprefix('torch.')}" for s, d in e) + "]"
        groups.setdefault(text, []).append(r)
    listing = "; ".join(f"rank(s) {', '.join(map(str, rs))}: {text}" for text, rs in groups.items())
    raise ValueError(f"the ranks passed inputs of different shapes or dtypes ({listing}); every "
                     f"rank must pass the same {expected}")
