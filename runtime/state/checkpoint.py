"""Crash-safe checkpoints of a ParallelModule, its optimizer and each rank's random state.

The tensors go through ``torch.distributed.checkpoint`` (DCP): the state dicts come from
``get_state_dict`` (parameter FQNs as the user's model names them, optimizer state keyed
by those FQNs) and hold DTensors, so every rank writes only its own blocks, and a
checkpoint loads into any mesh or plan -- another mesh shape, another world size, another
layout per parameter -- with DCP resharding on load.

``save_checkpoint(path, ...)`` never touches a checkpoint it has finished. ``path`` is a
directory of versions::

    path/latest                  the name of the newest complete version ("ckpt-000003")
    path/ckpt-000003/            DCP's files, rng-<rank>.pt, MANIFEST.json (written last)
    path/ckpt-000002/            the previous one (``keep`` versions are kept)
    path/.tmp-ckpt-000004-<id>/  a save in progress, or one that was interrupted

A save writes everything into a fresh ``.tmp-*`` directory and fsyncs it; rank 0 then
writes the manifest (every file with its size and SHA-256), renames the directory to its version
name and switches ``latest`` by an atomic rename. A rank killed at any point leaves the
previous version loadable and complete; ``load_checkpoint`` never loads a directory
without a manifest that matches its files, and names what it skipped. The next
successful save removes interrupted ``.tmp-*`` directories and versions beyond ``keep``.
Every rank must see the same ``path`` (one shared filesystem), as for DCP itself.

Checksums: each rank hashes the files it wrote (its DCP shard ``__<rank>_*.distcp`` and
``rng-<rank>.pt``; rank 0 also ``.metadata``), and the manifest holds every file's
SHA-256 (``sha256sum`` checks one by hand). ``load_checkpoint`` verifies them before
reading any tensor, the ranks sharing the work (one small all-gather of the findings), so
a flipped byte anywhere stops every rank with a ``CheckpointError`` naming the file.
What then: by default the error says which previous version is intact and how to load
it; ``load_checkpoint(..., fallback=True)`` loads the newest intact version itself, with
a warning naming the damaged one. Falling back is not the default because it silently
rewinds training by one or more saves -- a decision for the user (an automatic-restart
script that prefers losing steps over stopping passes ``fallback=True``).

A load is all or nothing. Checksums catch damage, not a file replaced together with its
manifest entry, which only reading finds: so every rank first reads its whole part (the
tensors into new ones, its random state without setting it), the ranks agree that every
part is good, and only then is anything applied. A module's extra state
(``get_extra_state``) is set first, on every module, and a module whose
``set_extra_state`` refuses it stops the load on every rank with each module's extra
state given back (``extra_state``). A refused load leaves the model, the optimizer and
the random state bit-identical, on every rank.

Loading runs no code from the checkpoint: DCP's metadata is unpickled by an unpickler
that only builds DCP's own metadata records (``_SafeReader``), DCP reads non-tensor
entries with ``torch.load(weights_only=True)``, the manifest and ``latest`` are plain
JSON / text, and the random states are read with ``weights_only=True``.

Random state: each rank's default CPU generator (and every CUDA generator, when CUDA is
available) is saved with the checkpoint and restored on load when the world size is the
same, so training with dropout resumes bit-identically. Loaded into another world size,
the random state is not restored (a warning says so).

Both functions are collective: every rank calls them with the same path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map

from torchalpa.core import placement as P
from torchalpa.runtime.execution import mesh
from torchalpa.runtime.execution.host_optimizer import over_parameters
from torchalpa.runtime.execution.mesh import gather_objects, on_rank0
from torchalpa.runtime.lowering.strided_dtensor import redistribute
from torchalpa.runtime.state import extra_state

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "latest_checkpoint",
           "checkpoint_extra"]

MANIFEST = "MANIFEST.json"
LATEST = "latest"
FORMAT = "torchalpa-checkpoint"
FORMAT_VERSION = 2               # 2: files hold {"bytes", "sha256"}; 1: sizes only
_READABLE_VERSIONS = (1, 2)
_VERSION_RE = re.compile(r"^ckpt-(\d{6,})$")
_TMP_RE = re.compile(r"^\.tmp-ckpt-(\d{6,})-[0-9a-f]+$")

# Tests set this to ``fn(point)`` to stop a rank at a named point of a save
# ("started", "data_written", "before_manifest", "before_rename", "before_latest",
# "before_prune"), e.g. by SIGKILL; nothing else uses it.
_fault_hook: Callable[[str], None] | None = None


class CheckpointError(ValueError):
    """A checkpoint directory is missing, partial or damaged; the message names it."""


def _reached(point: str) -> None:
    if _fault_hook is not None:
        _fault_hook(point)


def _parts(pmodel, optimizer):
    from torchalpa.runtime.execution.module import ParallelModule
    if not isinstance(pmodel, ParallelModule):
        raise TypeError(f"expected the ParallelModule returned by auto_parallel, got "
                        f"{type(pmodel).__name__}")
    optimizer = optimizer if optimizer is not None else pmodel.optimizer
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    return pmodel.module, optimizer


# -- small filesystem helpers -----------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file ``path`` (no symlink followed) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_durably(path: Path, data: bytes) -> None:
    """Atomically make ``path`` hold ``data``: a fsynced temporary file renamed over it."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    _write_durably(tmp, data)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# -- what a checkpoint directory holds --------------------------------------------------

def _number(pattern: re.Pattern[str], name: str) -> int:
    match = pattern.match(name)
    assert match is not None, name  # callers pass names the pattern already matched
    return int(match.group(1))


def _versions(root: Path) -> list[str]:
    """Committed version names under ``root``, oldest first."""
    if not root.is_dir():
        return []
    names = [p.name for p in root.iterdir() if _VERSION_RE.match(p.name) and p.is_dir()]
    return sorted(names, key=lambda n: _number(_VERSION_RE, n))


def _partials(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if _TMP_RE.match(p.name))


def _next_version(root: Path) -> str:
    numbers = [_number(_VERSION_RE, n) for n in _versions(root)]
    numbers += [_number(_TMP_RE, n) for n in _partials(root)]
    return f"ckpt-{max(numbers, default=0) + 1:06d}"


def _read_manifest(version_dir: Path) -> dict:
    """The manifest of a committed version, checked against the files it lists (that
    each is there with its size; the checksums are verified by ``_verify_checksums``).
    ``files`` is returned as ``{name: {"bytes": n, "sha256": hex or None}}``."""
    path = version_dir / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{version_dir} has no {MANIFEST}: it is not a complete "
                              "torchalpa checkpoint (a save that was interrupted?)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is unreadable ({e}); the checkpoint is damaged") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path} is not a torchalpa checkpoint manifest")
    if manifest.get("version") not in _READABLE_VERSIONS:
        raise CheckpointError(f"{path} has checkpoint format version "
                              f"{manifest.get('version')!r}; this torchalpa reads "
                              f"versions {', '.join(map(str, _READABLE_VERSIONS))}")
    files = {}
    for name, entry in manifest["files"].items():
        if not isinstance(name, str) or "/" in name or name.startswith(".."):
            raise CheckpointError(f"{path} lists a file outside its directory: {name!r}")
        entry = {"bytes": entry, "sha256": None} if manifest["version"] == 1 else entry
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) \
                or not isinstance(entry.get("sha256"), str):
            raise CheckpointError(f"{path}: the entry of {name} is not "
                                  '{"bytes": int, "sha256": str}; the manifest is damaged')
        file = version_dir / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {version_dir} is damaged: {name} is missing")
        if file.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"checkpoint {version_dir} is damaged: {name} has "
                                  f"{file.stat().st_size} bytes, the manifest says "
                                  f"{entry['bytes']}")
        files[name] = entry
    manifest["files"] = files
    return manifest


# -- checksums -----------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _written_by(name: str, rank: int) -> bool:
    """Whether rank ``rank`` wrote (and so hashes) the file ``name`` of a save: its DCP
    shard files and its random state; rank 0 also DCP's ``.metadata`` and any other."""
    if name == _rng_file(rank) or re.fullmatch(rf"__{rank}_\d+\.distcp", name):
        return True
    if rank != 0:
        return False
    return not (re.fullmatch(r"__\d+_\d+\.distcp", name) or re.fullmatch(r"rng-\d+\.pt", name))


def _hash_own_files(directory: Path, rank: int) -> dict[str, str]:
    """SHA-256 of the files this rank wrote, then every rank's (one all-gather)."""
    mine = {p.name: _sha256(p) for p in sorted(directory.iterdir())
            if p.is_file() and _written_by(p.name, rank)}
    return {name: digest for part in gather_objects(mine) for name, digest in part.items()}


def _verify_checksums(directory: Path, manifest: dict) -> list[str]:
    """The files of ``directory`` whose SHA-256 differs from the manifest's, as messages.
    Collective when a process group is up: rank r hashes every world-th file, and the
    findings are all-gathered, so every rank gets the same answer."""
    rank, world = mesh.rank(), mesh.world_size()
    names = sorted(n for n, e in manifest["files"].items() if e["sha256"] is not None)
    bad = []
    for name in names[rank::world]:
        expected = manifest["files"][name]["sha256"]
        try:
            actual = _sha256(directory / name)
        except OSError as e:
            bad.append(f"{name} is unreadable ({e})")
            continue
        if actual != expected:
            bad.append(f"{name} does not match its checksum (sha256 {actual[:16]}..., the "
                       f"manifest says {expected[:16]}...)")
    return sorted(m for part in gather_objects(bad) for m in part)


def latest_checkpoint(path: str | os.PathLike) -> Path:
    """The complete version ``load_checkpoint(path)`` would load; ``CheckpointError`` if
    there is none. ``path`` may also name one version directory."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint at {os.fspath(path)!r} (save_checkpoint "
                              "writes a directory)")
    if (root / MANIFEST).exists():
        _read_manifest(root)
        return root
    partial = _partials(root)
    if partial:
        warnings.warn(f"{root} holds {len(partial)} partial checkpoint(s) from interrupted "
                      f"saves, not loaded: {', '.join(partial)} (the next save removes them)",
                      stacklevel=3)
    pointer = root / LATEST
    if pointer.exists():
        name = pointer.read_text().strip() if pointer.is_file() else ""
        if not _VERSION_RE.match(name):
            raise CheckpointError(f"{pointer} does not name a checkpoint version ({name[:80]!r});"
                                  " point it at one of " + (", ".join(_versions(root)) or "none"))
        _read_manifest(root / name)
        return root / name
    versions = _versions(root)            # the first save was stopped before `latest`
    for name in reversed(versions):
        try:
            _read_manifest(root / name)
            return root / name
        except CheckpointError:
            continue
    if (root / ".metadata").is_file():    # a DCP directory from an older torchalpa
        warnings.warn(f"{root} is a checkpoint from an older torchalpa (no {MANIFEST}); it "
                      "cannot be checked for completeness and holds no random state",
                      stacklevel=3)
        return root
    what = f"only partial ones ({', '.join(partial)})" if partial else "none"
    raise CheckpointError(f"no complete checkpoint in {root}: {what}")


def checkpoint_extra(path: str | os.PathLike) -> dict:
    """The ``extra`` data saved with the checkpoint ``load_checkpoint(path)`` loads."""
    directory = latest_checkpoint(path)
    if not (directory / MANIFEST).exists():
        return {}
    extra = _read_manifest(directory).get("extra", {})
    return extra if isinstance(extra, dict) else {}


# -- reading DCP metadata without running code ------------------------------------------

_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "BytesStorageMetadata", "ChunkStorageMetadata",
        "StorageMeta", "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
     ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and nothing else: any other global is refused."""

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.source} refers to {module}.{name}, which is not part of "
                              "a checkpoint's metadata; refusing to load it (the file was "
                              "altered or is not a torchalpa/DCP checkpoint)")


class _SafeReader(FileSystemReader):
    """DCP's filesystem reader with a metadata unpickler that cannot run code."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f, str(path)).load()
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e}); the "
                                  "checkpoint is damaged") from e
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} does not hold DCP metadata")
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        """DCP's read, one file at a time, so that a file it cannot read is named."""
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path,
                               []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as e:
                lines = str(e).strip().splitlines()
                raise CheckpointError(f"{name} is unreadable ({type(e).__name__}: "
                                      f"{lines[0][:300] if lines else ''})") from e
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done


# -- random state ------------------------------------------------------------------------

def _rng_file(rank: int) -> str:
    return f"rng-{rank}.pt"


def _save_rng(directory: Path, rank: int) -> None:
    state: dict[str, torch.Tensor | list[torch.Tensor]] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    path = directory / _rng_file(rank)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _read_rng(directory: Path, manifest: dict | None, rank: int, world: int) -> dict | None:
    """This rank's saved random-number state, checked but not applied: None when there is
    none to restore (an old checkpoint, or another world size: a warning says so)."""
    if manifest is None:
        return None
    saved_world = manifest.get("world_size")
    if saved_world != world:
        warnings.warn(f"checkpoint {directory} was saved by {saved_world} ranks and is loaded "
                      f"by {world}: parameters and optimizer state are resharded, but the "
                      "random-number state is not restored (resume is not bit-identical "
                      "with dropout)", stacklevel=4)
        return None
    path = directory / _rng_file(rank)
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or not isinstance(state.get("cpu"), torch.Tensor):
        raise CheckpointError(f"{path} does not hold a random-number state")
    try:
        _try_rng(state)
    except Exception as e:
        raise CheckpointError(f"{path} does not hold a random-number state this process "
                              f"accepts ({type(e).__name__}: {e})") from e
    return state


def _set_rng(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and state.get("cuda") is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


def _try_rng(state: dict) -> None:
    """Set the generators from ``state``, then give each the state it had: raises if they
    refuse ``state``, and changes nothing either way."""
    current: dict = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and state.get("cuda") is not None:
        current["cuda"] = torch.cuda.get_rng_state_all()
    try:
        _set_rng(state)
    finally:
        _set_rng(current)


# -- the two entry points -----------------------------------------------------------------

def save_checkpoint(path: str | os.PathLike, pmodel, optimizer=None, *,
                    keep: int | None = 2, extra: dict | None = None) -> Path:
    """Save the model's parameters and buffers, the optimizer's state and every rank's
    random-number state as a new version under the directory ``path``; return it.

    ``optimizer`` defaults to ``pmodel.optimizer`` (the one given to ``auto_parallel``).
    The newest ``keep`` versions are kept (``None``: all). A crash at any point leaves
    the previous version complete and loadable (see the module docstring). ``extra``:
    plain JSON data (the step, the epoch...) committed with the version, read back by
    ``checkpoint_extra``.
    """
    module, optimizer = _parts(pmodel, optimizer)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be an int >= 1 (how many checkpoints to keep) or None "
                         f"(keep all), got {keep!r}")
    try:
        extra_json = json.loads(json.dumps(extra if extra is not None else {}))
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra must be plain JSON data (dict of str, numbers, lists), "
                        f"got {extra!r}: {e}") from e
    # the module's fault monitor names a peer that dies mid-save (``RankFailedError``)
    # instead of letting it surface as a bare timeout
    with pmodel._monitor.guard(f"save_checkpoint({os.fspath(path)!r})"):
        return _save(Path(path), module, optimizer, keep, extra_json)


def _save(root: Path, module, optimizer, keep: int | None, extra: dict) -> Path:
    rank, world = mesh.rank(), mesh.world_size()

    def begin():
        if root.exists() and not root.is_dir():
            raise CheckpointError(f"{root} exists and is not a directory; save_checkpoint "
                                  "writes a directory of versions there")
        root.mkdir(parents=True, exist_ok=True)
        name = _next_version(root)
        tmp = root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return name, str(tmp)

    name, tmp = on_rank0(begin, "starting the checkpoint")
    tmp = Path(tmp)
    _reached("started")
    dcp.save(_strided_as_shards(_state_dicts(module, optimizer)),
             storage_writer=FileSystemWriter(tmp, sync_files=True))
    _save_rng(tmp, rank)
    _reached("data_written")
    # every rank hashes its own files; the all-gather also means that every rank's
    # files are on disk before rank 0 commits
    digests = _hash_own_files(tmp, rank)

    def commit():
        _reached("before_manifest")
        files = {p.name: {"bytes": p.stat().st_size,
                          "sha256": digests.get(p.name) or _sha256(p)}
                 for p in sorted(tmp.iterdir()) if p.is_file()}
        missing = [_rng_file(r) for r in range(world) if _rng_file(r) not in files]
        if missing:
            raise CheckpointError(f"{tmp}: files of other ranks are not visible here "
                                  f"({', '.join(missing)}); every rank must save to one "
                                  "shared filesystem")
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "world_size": world,
                    "files": files, "extra": extra}
        _write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        _reached("before_rename")
        os.rename(tmp, root / name)
        _fsync_dir(root)
        _reached("before_latest")
        _replace_durably(root / LATEST, (name + "\n").encode())
        _reached("before_prune")
        _prune(root, keep, current=name)
        return str(root / name)

    return Path(on_rank0(commit, "committing the checkpoint"))


def _state_dicts(module, optimizer) -> dict:
    """What DCP saves and loads: the model's state dict, and the optimizer's if any."""
    if optimizer is None:
        return {"model": get_model_state_dict(module)}
    with over_parameters(optimizer):       # a host optimizer keyed by the module's names
        model_sd, optim_sd = get_state_dict(module, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def _strided_as_shards(state: dict) -> dict:
    """``state`` with every DTensor held as a strided shard (a fused q/k/v split by heads)
    moved to the plain shard of the same dim. DCP describes a rank's block by one offset
    and size, which a block of each of k pieces is not: it refuses to save one ("overlapping
    chunks") and loads into one wrongly. Plain shards save and load as any other, and the
    checkpoint reads the same whatever layout wrote it."""
    def plain(t):
        if isinstance(t, DTensor) and any(P.split_factor_of(p) > 1 for p in t.placements):
            return redistribute(t, [Shard(p.dim) if P.is_shard(p) and P.split_factor_of(p) > 1
                                    else p for p in t.placements])
        return t
    return tree_map(plain, state)


def _restore_strided(loaded: dict, like: dict) -> dict:
    """``loaded`` (from ``_strided_as_shards``) with each tensor back in the layout it has in
    ``like``."""
    def back(t, want):
        if isinstance(want, DTensor) and isinstance(t, DTensor) and t.placements != want.placements:
            return redistribute(t, want.placements)
        return t
    return tree_map(back, loaded, like)


def _prune(root: Path, keep: int | None, current: str) -> None:
    """Remove interrupted saves and the versions beyond ``keep`` (best effort)."""
    for name in _partials(root):
        shutil.rmtree(root / name, ignore_errors=True)
    if keep is None:
        return
    versions = [v for v in _versions(root) if v != current]
    for name in versions[:max(0, len(versions) - (keep - 1))]:
        shutil.rmtree(root / name, ignore_errors=True)


def load_checkpoint(path: str | os.PathLike, pmodel, optimizer=None, *,
                    rng: bool = True, fallback: bool = False) -> Path:
    """Load the newest complete checkpoint under ``path`` (or the version directory
    ``path`` names) into ``pmodel`` (and the optimizer), whatever mesh and plan it was
    saved with; return the version directory loaded.

    Partial checkpoints (interrupted saves) are never loaded. Every file is checked
    against the manifest's size and SHA-256 first; a damaged one raises
    ``CheckpointError`` naming the file and the intact version to load instead, or, with
    ``fallback=True``, the newest intact version is loaded with a warning naming the
    damaged ones. ``rng=True`` restores this rank's random-number state when the world
    size matches. The optimizer's state is created first if it has none (a
    zero-learning-rate step, as ``torch.distributed.checkpoint.state_dict`` does), then
    overwritten by the saved one.

    All or nothing: every rank reads and checks all of its part of the checkpoint (the
    tensors into new ones, the random state without setting it) before anything is
    applied, and the ranks agree that every part is good. A file that cannot be read on
    any rank raises ``CheckpointError`` on every rank naming it, with the model, the
    optimizer and the random state as they were (an optimizer state created for the load
    is removed again); so does a module whose ``set_extra_state`` refuses its saved
    extra state on any rank (every module's extra state is set before any tensor). The
    cost is room for a second copy of this rank's shards of the model and optimizer state
    while loading.
    """
    module, optimizer = _parts(pmodel, optimizer)
    directory, manifest = _intact_version(Path(path), fallback)
    random_state = _agreed_rng(directory, manifest) if rng else None
    made_state = optimizer if optimizer is not None and not optimizer.state else None
    state = _read_tensors(directory, module, optimizer)
    try:
        model_state = _set_extra_states(directory, module, state["model"])
    except BaseException:
        if made_state is not None:
            made_state.state.clear()      # as it was: the state made for the load goes
        raise
    # everything is read and checked, and the modules took their extra state: apply it
    # (without the extra state, set already: strict would call it missing)
    options = StateDictOptions(strict=len(model_state) == len(state["model"]))
    if optimizer is None:
        set_model_state_dict(module, model_state, options=options)
    else:
        with over_parameters(optimizer):
            set_state_dict(module, optimizer, model_state_dict=model_state,
                           optim_state_dict=state["optimizer"], options=options)
    if random_state is not None:
        _set_rng(random_state)
    return directory


def _set_extra_states(directory: Path, module, model_state: dict) -> dict:
    """Set every module's saved extra state, before any tensor is applied, and agree on it
    with the other ranks (one all-gather): a module that refuses on any rank raises on
    every rank, each module's extra state as it was (``extra_state``). Returns the
    model's state dict without those entries."""
    rest, extras = extra_state.split(module, model_state)
    applied, refusal = extra_state.set_all(extras)
    problems = [p for p in gather_objects(refusal and f"rank {mesh.rank()}: {refusal}") if p]
    if problems:
        extra_state.restore(applied)
        raise CheckpointError(
            f"checkpoint {directory} cannot be loaded: {'; '.join(problems)}. Nothing was "
            "loaded: the model, the optimizer and the random state are as they were. The "
            "module checks the extra state it loads: this checkpoint was saved by another "
            "version or configuration of it; load it into the model that saved it (or "
            "convert its extra state)")
    return rest


def _agreed_rng(directory: Path, manifest: dict | None) -> dict | None:
    """This rank's random state from ``directory`` (not applied), once every rank has read
    its own (one all-gather): a bad file on any rank raises on all of them."""
    problem = None
    state = None
    try:
        state = _read_rng(directory, manifest, mesh.rank(), mesh.world_size())
    except CheckpointError as e:
        problem = f"rank {mesh.rank()}: {e}"
    _refuse_if_any(directory, [p for p in gather_objects(problem) if p])
    return state


def _read_tensors(directory: Path, module, optimizer: torch.optim.Optimizer | None) -> dict:
    """The model's (and optimizer's) state dicts read from ``directory`` into new tensors
    laid out as the live ones, leaving those untouched. DCP's read is collective: a file
    that fails on one rank raises on every rank."""
    reader = _SafeReader(directory)
    reader.read_metadata()                # our error naming the file, before DCP wraps it
    made_state = optimizer if optimizer is not None and not optimizer.state else None
    try:
        layouts = _state_dicts(module, optimizer)     # may create the optimizer's state
        state = _strided_as_shards(layouts)
        state = tree_map(lambda t, live: t.detach().clone()          # new tensors to read into
                         if isinstance(t, torch.Tensor) and t is live else t, state, layouts)
        dcp.load(state, storage_reader=reader)
    except BaseException as e:
        if made_state is not None:
            made_state.state.clear()      # as it was: the state made for the load goes
        if isinstance(e, CheckpointException):
            raise CheckpointError(_refusal(directory, [
                f"rank {r}: {_first_line(error)}" for r, (error, _) in sorted(e.failures.items())
            ])) from e
        raise
    return _restore_strided(state, layouts)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _refuse_if_any(directory: Path, problems: list[str]) -> None:
    if problems:
        raise CheckpointError(_refusal(directory, problems))


def _refusal(directory: Path, problems: list[str]) -> str:
    """Why ``directory`` was not loaded (``problems``), that nothing changed, what to do."""
    older = []
    if _VERSION_RE.match(directory.name):
        below = _number(_VERSION_RE, directory.name)
        older = [v for v in _versions(directory.parent) if _number(_VERSION_RE, v) < below]
    instead = (f"load the previous version, load_checkpoint("
               f"{os.fspath(directory.parent / older[-1])!r}, ...), or " if older else "")
    head = (f"checkpoint {directory} cannot be loaded: {'; '.join(problems)}. Nothing was "
            "loaded: the model, the optimizer and the random state are as they were. ")
    if all(any(m in p for m in _OTHER_MODEL) for p in problems):
        return head + ("The checkpoint was saved from a model with other state (keys or "
                       "shapes): load it into the model that saved it (same modules, sizes "
                       "and extra state), or start from a checkpoint of this one")
    return head + ("The files match the manifest's checksums, so they were replaced or "
                   f"altered after the save (with the manifest rewritten to match); "
                   f"{instead}restore the files from a copy")


# DCP's words for a checkpoint of another model (torch's default_planner)
_OTHER_MODEL = ("Missing key in checkpoint state_dict", "Size mismatch between saved")


def _check_version(directory: Path) -> dict | None:
    """The manifest of ``directory`` once its files are all there with their sizes and
    checksums (None for an old DCP directory without one); ``CheckpointError`` if not."""
    if not (directory / MANIFEST).exists():
        return None
    manifest = _read_manifest(directory)
    bad = _verify_checksums(directory, manifest)
    if bad:
        raise CheckpointError(f"checkpoint {directory} is damaged: " + "; ".join(bad))
    return manifest


def _intact_version(path: Path, fallback: bool) -> tuple[Path, dict | None]:
    """The version to load and its manifest: the newest one (``latest_checkpoint``), or,
    when it is damaged, the newest intact older one if ``fallback`` is set (else an
    error naming it)."""
    newest: Path | None = None
    try:
        newest = latest_checkpoint(path)
        return newest, _check_version(newest)
    except CheckpointError as damage:
        error = damage
    if newest is not None and _VERSION_RE.match(newest.name):
        root, below = newest.parent, _number(_VERSION_RE, newest.name)
    elif (path / LATEST).is_file():      # `latest` names a damaged or no version
        name = (path / LATEST).read_text().strip()
        root, below = path, _number(_VERSION_RE, name) if _VERSION_RE.match(name) else None
    else:
        raise error
    older = [root / v for v in reversed(_versions(root))
             if below is None or _number(_VERSION_RE, v) < below]
    damaged = [str(error)]
    for candidate in older:
        try:
            manifest = _check_version(candidate)
        except CheckpointError as e:
            if str(e) not in damaged:
                damaged.append(str(e))
            continue
        if not fallback:
            raise CheckpointError(
                f"{error}. The file was altered or corrupted on disk; the previous version "
                f"{candidate} is intact: load it with load_checkpoint({os.fspath(root)!r}, "
                f"..., fallback=True) or load_checkpoint({os.fspath(candidate)!r}, ...), or "
                "restore the damaged file from a copy") from error
        warnings.warn(f"{'; '.join(damaged)}; loading the newest intact version, "
                      f"{candidate}, instead (fallback=True): training resumes from an "
                      "earlier save", stacklevel=3)
        return candidate, manifest
    raise CheckpointError(f"{'; '.join(damaged)}. No intact earlier version to fall back "
                          "to; restore the damaged file from a copy") from error
