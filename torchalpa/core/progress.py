"""What torchalpa tells a person while it works: logging setup and progress lines.

Everything goes through Python ``logging`` under the ``torchalpa`` logger, so an
application that configures logging gets torchalpa's records like any other library's.
If nothing is configured (the root logger has no handler), torchalpa shows its own
records on stderr at the level ``TORCHALPA_LOG`` names (``debug``, ``info`` -- the
default --, ``warning``, ``error``), on rank 0 only (other ranks show warnings and errors):
with ``rich`` on a terminal (a spinner while a long step runs), plain lines otherwise.

``step("mesh 3/5 (8x8) solving")`` wraps a long step: a spinner on a terminal, a line
before and after in a log, and every ``HEARTBEAT_S`` a line saying it still works and
what is left (``left("layer ILPs 40/80")``, said by whatever does the work, e.g. a pool of
worker processes counting its results: the heartbeat runs on a thread of its own, so it
speaks while this process waits on them). Of steps inside steps only the innermost
speaks. ``verbose(True)`` additionally streams the ILP solver's own log
(``plan(..., verbose=True)``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import threading
import time
from typing import Any

__all__ = ["log", "setup_logging", "step", "left", "verbose", "solver_verbose", "LEVELS",
           "HEARTBEAT_S"]

HEARTBEAT_S = 8.0
"""A step that runs longer says it is still working this often (plain lines in a log; on
a terminal the spinner shows the seconds): under the 10 s a person should ever wait for
a line, with room for a loaded machine's delays (at load 12 on 2 cores a 10-s beat came
10.3 s after the line before it)."""

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
    """The result line of a step: set ``done`` to say how it ended; ``left`` is what is
    left of it (the heartbeat's lines say it)."""

    def __init__(self, what: str):
        self.what = what
        self.done = ""
        self.left = ""
        self.start = time.perf_counter()
        self.spinner: Any = None    # its spinner on a terminal (an outer step's, if inside one)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


@contextlib.contextmanager
def step(what: str, *, level: int = logging.INFO):
    """``with step("mesh 1/3 (2x4) solving") as s: ...; s.done = "est 12 ms/step"``.

    Logs ``"<what>..."`` before (a spinner on a terminal instead) and
    ``"<what>: <seconds> s, <done>"`` after; a failure is logged with its reason. Every
    ``HEARTBEAT_S`` in between it says it is still working and what is left of it
    (``left``): the spinner's text on a terminal, a plain line in a log, so a long step is
    never silent. A step inside another takes over its spinner (one live display on a
    terminal) and its heartbeat (one line per beat, the innermost step's).
    """
    s = _Step(what)
    speaks = log.isEnabledFor(level)
    outer = next((o for o in reversed(_open) if o.spinner is not None), None)
    if speaks and outer is not None:
        s.spinner = outer.spinner            # shown in the outer's spinner meanwhile
        outer.spinner.update(f"{what}...")
    elif _handler is not None and speaks and _fancy() and \
            not logging.getLogger().handlers and not _verbose.get():
        from rich.console import Console
        s.spinner = Console(stderr=True).status(f"{what}...")
        s.spinner.start()
    else:
        log.log(level, "%s...", what)
    stop = threading.Event()
    beat = None
    if speaks:
        _open.append(s)
        beat = threading.Thread(target=_heartbeat, args=(s, level, stop),
                                name="torchalpa-progress", daemon=True)
        beat.start()
    try:
        yield s
    except Exception as e:
        # the first line: the error itself, raised to the caller, says the rest
        lines = str(e).splitlines() or [type(e).__name__]
        log.log(level, "%s: failed after %.1f s: %s%s", what, s.seconds, lines[0],
                " (...)" if len(lines) > 1 else "")
        raise
    finally:
        stop.set()
        if beat is not None:
            beat.join()
            _open.remove(s)
        if s.spinner is not None and s.spinner is not getattr(outer, "spinner", None):
            s.spinner.stop()
        elif outer is not None and s.spinner is not None:
            s.spinner.update(f"{outer.what}... {outer.seconds:.0f} s")
    log.log(level, "%s: %.1f s%s", what, s.seconds, f", {s.done}" if s.done else "")


_speaking = threading.Lock()
"""Held by a heartbeat while it writes, and by a fork while it copies the process: the
search forks solver processes while a step's heartbeat runs, and a child forked in the
middle of a heartbeat's write would inherit the output stream's lock held by a thread it
does not have, and wait on it forever at its first log line."""
os.register_at_fork(before=_speaking.acquire, after_in_parent=_speaking.release,
                    after_in_child=_speaking.release)


_open: list[_Step] = []
"""The steps running now whose level is shown, outermost first (steps nest on the thread
that plans)."""


def left(text: str) -> None:
    """Say what is left of the innermost step running (``"layer ILPs 40/80 solved"``):
    its next heartbeat line, or its spinner, shows it. Nothing when no step runs (a
    worker process, or a phase nobody wrapped)."""
    if _open:
        _open[-1].left = text


def _heartbeat(s: _Step, level: int, stop: threading.Event) -> None:
    """Say every ``HEARTBEAT_S`` that step ``s`` is still working, and what is left of it,
    until ``stop``; quiet while a step inside it runs (that one speaks)."""
    while not stop.wait(HEARTBEAT_S):
        if _open and _open[-1] is not s:
            continue
        left_text = f"; {s.left}" if s.left else ""
        with _speaking:
            if s.spinner is not None:
                s.spinner.update(f"{s.what}... {s.seconds:.0f} s{left_text}")
            else:
                log.log(level, "%s: still working, %.0f s%s", s.what, s.seconds, left_text)


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
