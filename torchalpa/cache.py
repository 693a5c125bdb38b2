"""Plans cached on disk, keyed by everything that decides them.

The key hashes the captured graph's fingerprint, the logical mesh (shape and costs), the
method and its options, the input mode, and the planner's own source code, so a cached
plan is reused only when solving again would give the same answer. Directory:
``$TORCHALPA_CACHE_DIR``, else ``$XDG_CACHE_HOME/torchalpa``, else ``~/.cache/torchalpa``;
``TORCHALPA_CACHE=0`` turns caching off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from torchalpa.plan import PipelinePlan, Plan, load_plan

__all__ = ["plan_key", "load_cached", "store", "cache_dir", "entries", "clear", "trim", "max_bytes",
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
    """Hash of the planner's code: a change to any pass invalidates cached plans."""
    import torchalpa
    import torchalpa.passes as passes
    h = hashlib.sha256(torchalpa.__version__.encode())
    for root in (Path(passes.__file__).parent, Path(torchalpa.__file__).parent):
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


def load_cached(key: str) -> Plan | PipelinePlan | None:
    root = cache_dir()
    if root is None:
        return None
    path = root / f"{key}.json"
    if not path.exists():
        return None
    try:
        plan = load_plan(path)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        log.warning("ignoring unreadable cached plan %s: %s", path, e)
        return None
    log.info("reusing cached plan %s", path)
    return plan


def store(key: str, plan: Plan | PipelinePlan) -> None:
    root = cache_dir()
    if root is None:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{key}.{os.getpid()}.tmp"
        plan.save(tmp)
        os.replace(tmp, root / f"{key}.json")     # atomic: readers never see half a file
    except OSError as e:
        log.warning("could not cache the plan in %s: %s", root, e)


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
