"""Plans cached on disk, keyed by everything that decides them.

The key hashes the captured graph's fingerprint, the logical mesh (shape and costs), the
method and its options, the input mode, and the planner's own source code, so a cached
plan is reused only when solving again would give the same answer. Directory:
``$TORCHALPA_CACHE_DIR``, else ``$XDG_CACHE_HOME/torchalpa``, else ``~/.cache/torchalpa``;
``TORCHALPA_CACHE=0`` turns caching off.

Nothing in the cache is trusted. The directory must be this user's and is kept at mode
0700 (one owned by another user is refused with a warning, and the cache is off); an
entry is opened without following symlinks and must be a regular file of this user;
every entry is parsed and checked against the step being planned (``validate``, see
``torchalpa.core.plan_check``) before it is returned. Anything else -- unreadable, truncated,
edited, another model's plan, a directory -- is a miss with a warning naming the file,
and the fresh plan overwrites it. New entries are written to an ``O_EXCL`` temporary
file (``mkstemp``) and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from torchalpa.core.plan import PipelinePlan, Plan, PlanError, parse_plan

__all__ = ["plan_key", "load_cached", "store", "cache_dir", "entries", "clear", "trim", "max_bytes",
           "usable_root",
           "CacheEntry"]

log = logging.getLogger("torchalpa.cache")


def cache_dir() -> Path | None:
    if os.environ.get("TORCHALPA_CACHE", "1") == "0":
        return None
    root = os.environ.get("TORCHALPA_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchalpa"


@lru_cache(maxsize=1)
def _planner_source_hash() -> str:
    """Hash of the planner's code: a change to any pass, to the capture (frontends), or to
    anything in the torchalpa package folder (its version string included), invalidates
    cached plans."""
    import torchalpa.frontends as frontends
    import torchalpa.passes as passes
    h = hashlib.sha256()
    for root in (Path(passes.__file__).parent, Path(frontends.__file__).parent,
                 Path(__file__).resolve().parents[1]):
        for path in sorted(root.rglob("*.py")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def plan_key(fingerprint: str, mesh, method, inputs: str) -> str:
    """``mesh``: the LogicalMesh of an intra-op plan, or the Cluster of a pipeline plan."""
    payload = json.dumps({"graph": fingerprint, "mesh": asdict(mesh), "method": method.to_dict(),
                          "inputs": inputs, "code": _planner_source_hash()},
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)
    log.warning(message)


def _my_uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def usable_root(create: bool) -> Path | None:
    """The cache directory if it is safe to use (this user's, mode 0700), else None."""
    root = cache_dir()
    if root is None:
        return None
    try:
        if create and not os.path.lexists(root):
            os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.lstat(root)
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn(f"the plan cache {root} is not usable ({e}); plans are not cached")
        return None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        _warn(f"the plan cache {root} is a symlink or not a directory; plans are not cached "
              "(point TORCHALPA_CACHE_DIR at a directory of your own)")
        return None
    uid = _my_uid()
    if uid is not None and st.st_uid != uid:
        _warn(f"the plan cache {root} belongs to uid {st.st_uid}, not to you (uid {uid}); plans "
              "are not cached (point TORCHALPA_CACHE_DIR at a directory of your own)")
        return None
    if uid is not None and stat.S_IMODE(st.st_mode) != 0o700:
        try:
            os.chmod(root, 0o700)
        except OSError as e:
            _warn(f"the plan cache {root} has mode {stat.S_IMODE(st.st_mode):o} and cannot be "
                  f"made private ({e}); plans are not cached")
            return None
    return root


def _read_entry(path: Path) -> str | None:
    """The text of a cache entry: a regular file of this user, opened without following
    a symlink; None (with a warning) for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn(f"ignoring the cached plan {path}: cannot open it without following links ({e}); "
              "planning again")
        return None
    try:
        st = os.fstat(fd)
        uid = _my_uid()
        if not stat.S_ISREG(st.st_mode) or (uid is not None and st.st_uid != uid):
            _warn(f"ignoring the cached plan {path}: not a regular file of yours; planning again")
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read().decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def load_cached(key: str, validate: Callable[[Plan | PipelinePlan, str], None] | None = None
                ) -> Plan | PipelinePlan | None:
    """The plan cached under ``key``, or None. ``validate(plan, path)`` raises
    ``PlanError`` for a plan that does not fit the step being planned: a miss."""
    root = usable_root(create=False)
    if root is None:
        return None
    path = root / f"{key}.json"
    text = _read_entry(path)
    if text is None:
        return None
    try:
        plan = parse_plan(text, str(path))
        if validate is not None:
            validate(plan, str(path))
    except PlanError as e:
        _warn(f"ignoring the cached plan: {e}; planning again (the new plan replaces it)")
        return None
    log.info("reusing cached plan %s", path)
    return plan


def store(key: str, plan: Plan | PipelinePlan) -> None:
    root = usable_root(create=True)
    if root is None:
        return
    target = root / f"{key}.json"
    try:
        if target.is_dir() and not target.is_symlink():
            target.rmdir()                  # an empty directory in the entry's place
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=root)  # O_EXCL, 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(plan.to_json())
            os.replace(tmp, target)         # atomic; replaces a symlink, never follows it
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        _warn(f"could not cache the plan as {target}: {e}")


# -- listing, clearing and the size cap (``torchalpa cache ls | clear``) ---------------------

DEFAULT_MAX_MB = 1024


@dataclass(frozen=True)
class CacheEntry:
    """One cached plan file: its key, size, age and what the plan says about itself."""

    key: str
    path: Path
    bytes: int
    mtime: float
    description: str


def max_bytes() -> int:
    """The cache's size cap: ``$TORCHALPA_CACHE_MAX_MB`` megabytes (default 1024)."""
    text = os.environ.get("TORCHALPA_CACHE_MAX_MB", str(DEFAULT_MAX_MB))
    try:
        mb = float(text)
    except ValueError:
        raise ValueError(f"TORCHALPA_CACHE_MAX_MB must be a number of megabytes, got {text!r}") \
            from None
    return int(mb * 2**20)


def _files(root: Path | None) -> list[Path]:
    if root is None or not root.is_dir():
        return []
    return [p for p in root.glob("*.json") if p.is_file() and not p.is_symlink()]


def _describe(path: Path) -> str:
    try:
        d = json.loads(path.read_text())
        shape = "x".join(map(str, d.get("mesh", {}).get("shape", [])))
        step = d.get("estimates", {}).get("step_time_s")
        kind = "pipeline" if d.get("kind") == "pipeline" else d.get("method", {}).get("name", "?")
        return f"{kind} mesh {shape}" + (f", est {step * 1e3:.3g} ms/step" if step else "")
    except (OSError, ValueError, AttributeError, TypeError):
        return "unreadable"


def entries() -> list[CacheEntry]:
    """The cached plans, newest first."""
    out = []
    for path in _files(cache_dir()):
        st = path.stat()
        out.append(CacheEntry(path.stem, path, st.st_size, st.st_mtime, _describe(path)))
    return sorted(out, key=lambda e: -e.mtime)


def clear() -> tuple[int, int]:
    """Delete every cached plan; returns (files, bytes) removed."""
    files = _files(cache_dir())
    total = 0
    for path in files:
        total += path.stat().st_size
        path.unlink(missing_ok=True)
    return len(files), total


def trim(limit: int | None = None) -> int:
    """Delete the oldest cached plans until the cache holds at most ``limit`` bytes
    (default ``max_bytes()``); returns how many were deleted."""
    limit = max_bytes() if limit is None else limit
    files = sorted(_files(cache_dir()), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in files)
    removed = 0
    for path in files:
        if total <= limit:
            break
        total -= path.stat().st_size
        path.unlink(missing_ok=True)
        removed += 1
    if removed:
        log.info("plan cache over %.0f MiB: removed the %d oldest plan(s)", limit / 2**20, removed)
    return removed
