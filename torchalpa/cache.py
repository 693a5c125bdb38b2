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
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

from torchalpa.plan import PipelinePlan, Plan, load_plan

__all__ = ["plan_key", "load_cached", "store", "cache_dir"]

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
