"""What torchalpa tells a person while it works: logging setup and progress lines.

Everything goes through Python ``logging`` under the ``torchalpa`` logger, so an
application that configures logging gets torchalpa's records like any other library's.
If nothing is configured (the root logger has no handler), torchalpa shows its own
records on stderr at the level ``TORCHALPA_LOG`` names (``debug``, ``info`` -- the
default --, ``warning``, ``error``), on rank 0 only (other ranks show warnings and errors):
with ``rich`` on a terminal (a spinner while a long step runs), plain lines otherwise.

``step("mesh 3/5 (8x8) solving")`` wraps a long step: a spinner on a terminal, a line
before and after in a log; ``verbose(True)`` additionally streams the ILP solver's own
log (``plan(..., verbose=True)``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import threading
import time

__all__ = ["log", "setup_logging", "step", "verbose", "solver_verbose", "LEVELS",
           "HEARTBEAT_S"]

HEARTBEAT_S = 10.0
"""A step that runs longer says it is still working this often (plain lines in a log; on
a terminal the spinner shows the seconds)."""

log = logging.getLogger("torchalpa")
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}
_verbose = contextvars.ContextVar("torchalpa_solver_verbose", default=False)
_handler: logging.Handler | None = None
_set_level: int | None = None        # the level setup_logging last gave the logger


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def _level() -> int:
    name = os.environ.get("TORCHALPA_LOG", "info").strip().lower()
    if name not in LEVELS:
        raise ValueError(f"TORCHALPA_LOG must be one of {sorted(LEVELS)}, got {name!r}")
    level = LEVELS[name]
    return level if _rank() == 0 else max(level, logging.WARNING)


def _fancy() -> bool:
    if not getattr(sys.stderr, "isatty", lambda: False)() or os.environ.get("TERM") == "dumb":
        return False
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


_DETAIL_LOGGERS = ("torchalpa.planner", "torchalpa.capture")


class _WhenUnconfigured(logging.Filter):
    """Ours prints only while the application has no logging of its own (then the
    records propagate to the root's handlers instead, shown once). The planner's and the
    capture's own info lines are details: shown with ``TORCHALPA_LOG=debug``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger().handlers:
            return False
        if record.name in _DETAIL_LOGGERS and record.levelno < logging.WARNING:
            return log.isEnabledFor(logging.DEBUG)
        return True


def setup_logging() -> None:
    """Install torchalpa's stderr handler once (idempotent; honours ``TORCHALPA_LOG``)."""
    global _handler, _set_level
    level = _level()
    if log.level in (logging.NOTSET, _set_level):     # never override the application's
        log.setLevel(level)
        _set_level = level
    if _handler is not None:
        _handler.setLevel(level)
        return
    if _fancy():
        from rich.logging import RichHandler
        _handler = RichHandler(show_path=False, show_level=False, markup=False,
                               log_time_format="[%X]")
        _handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(logging.Formatter("torchalpa: %(message)s"))
    _handler.setLevel(level)
    _handler.addFilter(_WhenUnconfigured())
    log.addHandler(_handler)


class _Step:
    """The result line of a step: set ``done`` to say how it ended."""

    def __init__(self, what: str):
        self.what = what
        self.done = ""
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


@contextlib.contextmanager
def step(what: str, *, level: int = logging.INFO):
    """``with step("mesh 1/3 (2x4) solving") as s: ...; s.done = "est 12 ms/step"``.

    Logs ``"<what>..."`` before (a spinner on a terminal instead) and
    ``"<what>: <seconds> s, <done>"`` after; a failure is logged with its reason. Every
    ``HEARTBEAT_S`` in between it says it is still working (the spinner's text on a
    terminal, a plain line in a log), so a long step is never silent.
    """
    s = _Step(what)
    spinner = None
    if _handler is not None and log.isEnabledFor(level) and _fancy() and \
            not logging.getLogger().handlers and not _verbose.get():
        from rich.console import Console
        spinner = Console(stderr=True).status(f"{what}...")
        spinner.start()
    else:
        log.log(level, "%s...", what)
    stop = threading.Event()
    beat = None
    if log.isEnabledFor(level):
        beat = threading.Thread(target=_heartbeat, args=(s, level, spinner, stop),
                                name="torchalpa-progress", daemon=True)
        beat.start()
    try:
        yield s
    except Exception as e:
        log.log(level, "%s: failed after %.1f s: %s", what, s.seconds, e)
        raise
    finally:
        stop.set()
        if beat is not None:
            beat.join()
        if spinner is not None:
            spinner.stop()
    log.log(level, "%s: %.1f s%s", what, s.seconds, f", {s.done}" if s.done else "")


_speaking = threading.Lock()
"""Held by a heartbeat while it writes, and by a fork while it copies the process: the
search forks solver processes while a step's heartbeat runs, and a child forked in the
middle of a heartbeat's write would inherit the output stream's lock held by a thread it
does not have, and wait on it forever at its first log line."""
os.register_at_fork(before=_speaking.acquire, after_in_parent=_speaking.release,
                    after_in_child=_speaking.release)


def _heartbeat(s: _Step, level: int, spinner, stop: threading.Event) -> None:
    """Say every ``HEARTBEAT_S`` that step ``s`` is still working, until ``stop``."""
    while not stop.wait(HEARTBEAT_S):
        with _speaking:
            if spinner is not None:
                spinner.update(f"{s.what}... {s.seconds:.0f} s")
            else:
                log.log(level, "%s: still working, %.0f s", s.what, s.seconds)


@contextlib.contextmanager
def verbose(on: bool = True):
    """Within it, the ILP solver prints its own log (``plan(..., verbose=True)``)."""
    token = _verbose.set(bool(on))
    try:
        yield
    finally:
        _verbose.reset(token)


def solver_verbose() -> bool:
    return _verbose.get()
