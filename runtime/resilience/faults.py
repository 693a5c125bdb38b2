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
- every rank beats a heartbeat counter in the store from a daemon thread (every
  ``HEARTBEAT_S``), and marks itself as gone when it exits normally. A rank whose
  counter stopped and that left no such mark is named as dead (killed by a signal, the
  out-of-memory killer, a crashed interpreter) -- and only it: healthy ranks still blocked
  in a collective keep beating, so they are never blamed for the dead one.

Under torchrun the agent stops the whole job with SIGTERM as soon as one worker dies;
``launcher_stop`` catches that signal (even while the main thread is blocked in a
collective) and makes every survivor end with ``RankFailedError`` naming the rank at
fault, from the same records and heartbeats. Launch with ``--max-restarts=N`` and resume
from ``load_checkpoint`` (``examples/resume.py``) to survive a dead rank.

Input shapes are compared across ranks on the first call (one small all-gather), so a rank
fed a different batch shape is named on every rank at once instead of after a timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from torchalpa.runtime.execution.mesh import gather_objects, world_size
from torchalpa.runtime.resilience import clean_exit, launcher_stop
from torchalpa.runtime.resilience.heartbeat import Heartbeat, failure_key
from torchalpa.runtime.resilience.rank_failure import RankFailedError, describe_culprits

__all__ = ["RankFailedError", "FaultMonitor", "check_same_inputs", "check_same_values",
           "describe_specs", "describe_culprits"]

_PREFIX = "torchalpa/"
_COMM_ERROR_HINTS = ("gloo", "Connection closed", "Connection reset", "Timed out", "timed out",
                     "NCCL", "Broken pipe", "Socket", "socket")



def _is_comm_error(e: BaseException) -> bool:
    return isinstance(e, dist.DistError) or (
        isinstance(e, RuntimeError) and any(h in str(e) for h in _COMM_ERROR_HINTS))


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
        clean_exit.install()
        if self.store is not None:
            self._install_excepthook()
            Heartbeat.start(self.store, self.rank, self.world_size)
            launcher_stop.install(self)

    # -- this rank ----------------------------------------------------------------------
    def record(self, error: BaseException) -> None:
        """Tell the other ranks that this one failed, and why (best effort)."""
        if self.store is None or isinstance(error, RankFailedError):
            return
        text = f"{type(error).__name__}: {error}".strip()
        try:
            self.store.set(failure_key(self.rank), text[:2000])
        except Exception:  # the store may be gone too; the local error still propagates
            pass

    def _install_excepthook(self) -> None:
        if FaultMonitor._hook_installed:
            return
        previous = sys.excepthook

        def hook(kind, value, tb):
            Heartbeat.handling.set()          # this process ends by its own error
            clean_exit.ending_with_error()
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
        """Which rank made this rank's collective fail, as a message for the user; the
        job's failure is announced to every rank's heartbeat (``heartbeat``)."""
        Heartbeat.handling.set()           # this rank ends by the error it is about to raise
        me = f"rank {self.rank}: {what} stopped because "
        first_line = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        tail = (f"\n(the collective error on rank {self.rank}: {type(error).__name__}: "
                f"{first_line})")
        try:
            failed, dead = self.culprits()
            self.leaving(failed, dead)
            missing = [] if failed or dead else self._roll_call()
        except RankFailedError:  # torchrun stopped this rank meanwhile: launcher_stop's word
            raise
        except Exception as e:  # the store lives on rank 0 or in the launcher
            return (me + "a peer stopped responding and the job's store is unreachable "
                    f"({type(e).__name__}); the store's host (rank 0 or the launcher) has "
                    "probably failed" + tail)
        if failed or dead:
            message = me + describe_culprits(failed, dead) + tail
        elif missing:
            ranks = ", ".join(map(str, missing))
            message = (me + f"rank(s) {ranks} did not respond (dead, hung, or no longer "
                       f"calling the model; collective timeout {self.timeout_s:g} s, set by "
                       "TORCHALPA_TIMEOUT_S)" + tail)
        else:
            message = me + "a collective failed on every rank; see the error below" + tail
        Heartbeat.announce_failure(message)
        self._wait_for_survivors(set(failed) | set(dead))
        return message

    def culprits(self) -> tuple[dict[int, str], list[int]]:
        """The ranks that recorded an error (with it), and the other ranks whose
        heartbeat stopped without leaving (dead). Takes a few heartbeats."""
        failed = self._failures()
        dead = [r for r in Heartbeat.stopped(self.world_size, self.rank) if r not in failed]
        return failed, dead

    def leaving(self, failed, dead) -> None:
        """Mark this rank as stopping because of others, so that ranks diagnosing later
        do not take its silent heartbeat for a death."""
        culprits = sorted(set(failed) | set(dead))
        why = f"stopped after rank(s) {', '.join(map(str, culprits))}" if culprits else "stopped"
        Heartbeat.left(self.rank, why)

    def _wait_for_survivors(self, gone: set[int]) -> None:
        """On rank 0, which hosts the store in a plain launch: stay until every other rank
        still alive has left (bounded by the collective timeout), so that this rank's exit
        does not take the store away from their diagnosis -- nor from a hung rank's
        heartbeat, which stops it once it reads the failure (``heartbeat``)."""
        if self.rank != 0:
            return
        others = [r for r in range(1, self.world_size) if r not in gone]
        Heartbeat.wait_until_left(others, time.monotonic() + self.timeout_s + 10.0)

    def _failures(self) -> dict[int, str]:
        store = self.store
        assert store is not None, "a job of several ranks has a store"
        out = {}
        for r in range(self.world_size):
            key = failure_key(r)
            if r != self.rank and store.check([key]):
                out[r] = store.get(key).decode(errors="replace")
        return out

    def _roll_call(self) -> list[int]:
        """Ranks that do not report within a grace period after this one failed."""
        store = self.store
        assert store is not None, "a job of several ranks has a store"
        store.set(f"{_PREFIX}alive/{self.rank}", "1")
        grace = min(10.0, max(2.0, 0.25 * self.timeout_s))
        deadline = time.monotonic() + grace
        others = [r for r in range(self.world_size) if r != self.rank]
        while True:
            missing = [r for r in others if not store.check([f"{_PREFIX}alive/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            if self._failures():
                return missing
            time.sleep(0.2)



def describe_specs(specs: Sequence[tuple[tuple[int, ...], torch.dtype | str]]) -> str:
    return "[" + ", ".join(f"{tuple(s)} {str(d).removeprefix('torch.')}" for s, d in specs) + "]"


def check_same_inputs(specs: list[tuple[tuple[int, ...], torch.dtype]], expected: str) -> None:
    """Every rank passes inputs of the same shapes and dtypes, or every rank raises a
    ValueError naming the ranks that differ (one all-gather of the shapes)."""
    if world_size() == 1:
        return
    everyone = gather_objects([(tuple(s), str(d)) for s, d in specs])
    if all(e == everyone[0] for e in everyone):
        return
    groups: dict[str, list[int]] = {}
    for r, e in enumerate(everyone):
        groups.setdefault(describe_specs(e), []).append(r)
    listing = "; ".join(f"rank(s) {', '.join(map(str, rs))}: {text}" for text, rs in groups.items())
    raise ValueError(f"the ranks passed inputs of different shapes or dtypes ({listing}); every "
                     f"rank must pass the same {expected}")


def batch_digest(inputs: Sequence[torch.Tensor]) -> str:
    """A hash of the inputs' values (bytes, shapes and dtypes)."""
    h = hashlib.blake2b(digest_size=16)
    for x in inputs:
        t = x.detach()
        h.update(f"{tuple(t.shape)} {t.dtype};".encode())
        h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_same_values(inputs: Sequence[torch.Tensor], what: str = "batch") -> None:
    """Every rank passes the same global batch (the same values), or every rank raises a
    ValueError naming the ranks whose batch differs from rank 0's (one all-gather)."""
    if world_size() == 1:
        return
    everyone = gather_objects(batch_digest(inputs))
    differ = [r for r, d in enumerate(everyone) if d != everyone[0]]
    if differ:
        raise ValueError(
            f"rank(s) {', '.join(map(str, differ))} passed a different {what} than rank 0 "
            "(same shapes, other values); with inputs='global' every rank must pass the same "
            "global batch -- check the data loader's seed and sampler, or use inputs='local' "
            "with a DistributedSampler (check_inputs='never' turns this check off)")
