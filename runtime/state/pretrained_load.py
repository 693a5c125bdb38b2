"""Into torchalpa: pretrained weights from safetensors, read straight into the shards.

``load_pretrained(pm, path)`` fills a ParallelModule's parameters and persistent buffers
from a safetensors snapshot -- HuggingFace's ``model.safetensors``, a sharded snapshot
(``model.safetensors.index.json`` and the files its ``weight_map`` names), or one
``.safetensors`` file (what ``torchalpa.save_pretrained`` writes). Each rank opens the files
lazily (``safe_open``) and reads, for every DTensor, only the block it holds
(``get_slice`` with the shard's global offset and local shape): a 70B snapshot loads into
64 ranks without any rank reading the whole model. Tensors are matched by the module's
own names (its state-dict FQNs, which are what ``save_pretrained`` writes); a tied weight
(``lm_head.weight`` sharing ``wte.weight``) is found under any of its names, as
HuggingFace stores it once.

As HuggingFace's ``from_pretrained`` does, it reports keys of the model missing from the
snapshot, keys of the snapshot the model does not have, and shape mismatches. Shape
mismatches are always an error; missing and unexpected keys are an error with
``strict=True`` (the default, since a silently random layer is the costlier mistake) and
a warning otherwise. Nothing is written into the model until every check passed.

Host memory. The files are read one at a time, each closed before the next is opened:
safetensors maps a file, and the pages a rank's reads touch count in its resident set
until the mapping goes, so a sharded snapshot's peak is one file's blocks (plus the block
being copied), not every file's. Each rank keeps, as ``pm.last_load`` (a ``LoadReport``;
rank 0 also logs its own), the bytes it read and its peak resident set during the load,
next to its resident set before: for a model built on ``meta`` and planned with its weights sharded,
that peak stays near the rank's share (tests/test_generate.py measures it).

Collective only in that every rank must call it (no communication happens).
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from torchalpa.core import placement as P
from torchalpa.core.units import format_bytes
from torchalpa.runtime.execution.collectives import local_chunk, local_split_factor
from torchalpa.runtime.measurement.host_memory import peak_rss_bytes, reset_peak, rss_bytes

__all__ = ["load_pretrained", "snapshot_files", "check_safetensors", "LoadReport"]

log = logging.getLogger("torchalpa")

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def snapshot_files(path: str | os.PathLike) -> dict[str, Path]:
    """Which file holds each tensor of the snapshot at ``path`` (a directory, an index
    json or one .safetensors file)."""
    path = Path(path)
    if path.is_dir():
        if (path / INDEX).is_file():
            path = path / INDEX
        elif (path / SINGLE).is_file():
            path = path / SINGLE
        else:
            found = sorted(p.name for p in path.glob("*.safetensors"))
            pickles = sorted(path.glob("*.bin"))
            hint = (f"; it has {', '.join(found[:5])}: pass one file's path" if found
                    else f"; it has {pickles[0].name}, a PyTorch pickle file: "
                    f"{_convert_hint(pickles[0])}" if pickles
                    else " (a PyTorch .bin snapshot? convert it to safetensors first)")
            raise FileNotFoundError(f"{path} holds neither {SINGLE} nor {INDEX}{hint}")
    if not path.is_file():
        raise FileNotFoundError(f"no safetensors snapshot at {os.fspath(path)!r}")
    if path.name.endswith(".json"):
        files = _indexed_files(path)
        for file in sorted(set(files.values())):
            check_safetensors(file, f"named by {path.name}")
        return files
    return {key: path for key in check_safetensors(path)}


_PICKLE_STARTS = (b"PK\x03\x04", b"\x80")     # torch.save's zip archive; a bare pickle
_MAX_HEADER = 100 << 20                        # safetensors' own limit on the JSON header


def _convert_hint(path: Path) -> str:
    return (f"convert it once, where you trust the file: safetensors.torch.save_file("
            f"torch.load({path.name!r}, weights_only=True), 'model.safetensors') (or "
            "transformers' from_pretrained(...).save_pretrained(dir), which writes "
            "safetensors)")


def check_safetensors(path: Path, named_by: str = "") -> list[str]:
    """The tensor names of the safetensors file ``path``, once its header is read and its
    size is the one the header describes; else a ValueError naming the file and what is
    wrong: a PyTorch pickle (``.bin``, refused: unpickling can run code) or a file cut
    short (expected and actual size). Only the header is read."""
    where = f"{path}" + (f" ({named_by})" if named_by else "")
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = f.read(8)
        length = int.from_bytes(start, "little") if len(start) == 8 else -1
        pickled = path.suffix in (".bin", ".pt", ".pth", ".ckpt") or \
            start.startswith(_PICKLE_STARTS)
        if pickled and not (0 < length <= _MAX_HEADER and f.read(1) == b"{"):
            raise ValueError(f"{where} is a PyTorch pickle file (torch.save), not safetensors: "
                             "load_pretrained reads safetensors only (unpickling can run "
                             f"code); {_convert_hint(path)}")
        if length < 2 or length > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{where} is not a safetensors file or is truncated: its first "
                             f"8 bytes give a {length}-byte header, the file has {size} bytes")
        f.seek(8)
        try:
            header = json.loads(f.read(length))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise ValueError(f"{where} is not a safetensors file: its header is not a "
                             f"table of tensors ({type(e).__name__}: {e})") from e
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise ValueError(f"{where} is {what}: its header describes {expected} bytes, the "
                         f"file has {size}; nothing was loaded. Download or copy it again")
    return [k for k in header if k != "__metadata__"]


def _indexed_files(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a safetensors index (a JSON object with a "
                         f"'weight_map' of tensor name -> file): {e}") from e
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to file names")
    files = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or "/" in name or name.startswith(".."):
            raise ValueError(f"{index} names a file outside its directory for {key}: {name!r}")
        file = index.parent / name
        if not file.is_file():
            raise FileNotFoundError(f"{index} maps {key} to {name}, which is missing from "
                                    f"{index.parent}")
        files[key] = file
    return files


def _targets(module: nn.Module) -> dict[str, list[str]]:
    """Each tensor to fill, by its first state-dict name, with all its names (tied)."""
    by_tensor: dict[int, list[str]] = {}
    state = module.state_dict(keep_vars=True)
    for name, tensor in state.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    return {names[0]: names for names in by_tensor.values()}


def _block(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The global offset and the shape of the block of ``tensor`` this rank reads: its
    own block, or for a strided shard (a block of each piece of a dim, which no one offset
    describes) the whole range of that dim, cut by ``_strided_part`` after reading."""
    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    placements = [Replicate() if P.split_factor_of(p) > 1 else p for p in tensor.placements]
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                          placements)
    return tuple(offset), tuple(shape)


def _strided_part(tensor: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """This rank's part of a block ``_block`` read whole along strided dims."""
    if not isinstance(tensor, DTensor):
        return block
    coords = tensor.device_mesh.get_coordinate()
    assert coords is not None, "this rank is not on the tensor's mesh"
    for axis, p in enumerate(tensor.placements):
        if P.is_shard(p) and P.split_factor_of(p) > 1:   # a nested one: a plain shard of the
            block = local_chunk(block, p.dim, tensor.device_mesh.size(axis), coords[axis],
                                local_split_factor(tensor.placements, axis,     # piece read
                                                   tuple(tensor.device_mesh.shape)))
    return block


@dataclass(frozen=True)
class LoadReport:
    """What one rank's ``load_pretrained`` read and the host memory it took."""

    bytes_read: int
    """Bytes of the blocks this rank read (its share of the snapshot)."""
    snapshot_bytes: int
    """Bytes of every tensor the model loaded, whole (what one device would read)."""
    files: int
    rss_before_bytes: int | None
    """Resident set size when the load started (None where the system does not say)."""
    peak_rss_bytes: int
    """Its high-water mark during the load (since the process started where it cannot be
    reset: ``runtime/measurement/host_memory.py``)."""
    seconds: float

    def __str__(self) -> str:
        before = "?" if self.rss_before_bytes is None else format_bytes(self.rss_before_bytes)
        return (f"read {format_bytes(self.bytes_read)} of {format_bytes(self.snapshot_bytes)} "
                f"from {self.files} file(s) in {self.seconds:.2f}s; host memory (RSS) "
                f"{before} before, peak {format_bytes(self.peak_rss_bytes)}")


@torch.no_grad()
def load_pretrained(pm, path: str | os.PathLike, *, strict: bool = True) -> dict[str, list[str]]:
    """Fill ``pm``'s parameters and persistent buffers from the safetensors snapshot at
    ``path``, each rank reading only its blocks (see the module docstring). Returns
    ``{"missing_keys": [...], "unexpected_keys": [...]}`` as HuggingFace does; what this
    rank read and its peak host memory are kept as ``pm.last_load`` (and logged)."""
    module = getattr(pm, "module", None)
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected the ParallelModule returned by auto_parallel, got "
                        f"{type(pm).__name__}")
    files = snapshot_files(path)
    targets = _targets(module)
    state = module.state_dict(keep_vars=True)
    found = {first: next((n for n in names if n in files), None)
             for first, names in targets.items()}
    missing = sorted(first for first, key in found.items() if key is None)
    known = {n for names in targets.values() for n in names}
    unexpected = sorted(k for k in files if k not in known)
    by_file: dict[Path, list[tuple[torch.Tensor, str]]] = {}
    for first, key in found.items():
        if key is not None:
            by_file.setdefault(files[key], []).append((state[first], key))
    mismatched = _check_shapes(by_file)
    _report(type(module).__name__, path, missing, unexpected, mismatched, strict)
    rss_before, began = rss_bytes(), time.perf_counter()
    reset_peak()
    read = whole = 0
    for file, reads in by_file.items():
        n, m = _read_file(file, reads)
        read, whole = read + n, whole + m
    report = LoadReport(bytes_read=read, snapshot_bytes=whole, files=len(by_file),
                        rss_before_bytes=rss_before, peak_rss_bytes=peak_rss_bytes(),
                        seconds=time.perf_counter() - began)
    log.info("load_pretrained: %s", report)
    pm.last_load = report
    return {"missing_keys": missing, "unexpected_keys": unexpected}


def _check_shapes(by_file: dict[Path, list[tuple[torch.Tensor, str]]]) -> list[str]:
    """Shape mismatches between the model and the snapshot (headers only are read), or a
    NotImplementedError for a tensor no value can be loaded into."""
    from safetensors import safe_open
    mismatched = []
    for file, reads in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            for tensor, key in reads:
                saved_shape = tuple(handle.get_slice(key).get_shape())
                if saved_shape != tuple(tensor.shape):
                    mismatched.append(f"{key}: the snapshot has shape {list(saved_shape)}, "
                                      f"the model {list(tensor.shape)}")
                elif isinstance(tensor, DTensor) and \
                        any(p.is_partial() for p in tensor.placements):
                    raise NotImplementedError(f"{key} is a partial sum across ranks "
                                              f"({tensor.placements}); cannot load a value "
                                              "into it")
    return mismatched


def _read_file(file: Path, reads: list[tuple[torch.Tensor, str]]) -> tuple[int, int]:
    """Copy this rank's block of each tensor from ``file`` (opened for these reads only);
    returns (bytes read, bytes of the tensors whole)."""
    from safetensors import safe_open
    read = whole = 0
    with safe_open(str(file), framework="pt") as handle:
        for tensor, key in reads:
            offset, shape = _block(tensor)
            view = handle.get_slice(key)
            block = (view[tuple(slice(o, o + s) for o, s in zip(offset, shape))] if shape
                     else handle.get_tensor(key))
            read += block.numel() * block.element_size()
            whole += tensor.numel() * block.element_size()
            block = _strided_part(tensor, block)
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            assert tuple(block.shape) == tuple(local.shape), (key, block.shape, local.shape)
            local.copy_(block)
            del block
    return read, whole


def _report(model: str, path, missing: list[str], unexpected: list[str],
            mismatched: list[str], strict: bool) -> None:
    where = os.fspath(path)

    def listing(keys: list[str]) -> str:
        shown = ", ".join(keys[:10])
        return shown + (f" (and {len(keys) - 10} more)" if len(keys) > 10 else "")

    problems = []
    if mismatched:
        problems.append("size mismatch for " + "; ".join(mismatched))
    if missing:
        problems.append(f"missing keys (in the model, not in the snapshot): {listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys (in the snapshot, not in the model): "
                        f"{listing(unexpected)}")
    if not problems:
        return
    text = f"loading {where} into {model}: " + "; ".join(problems)
    if mismatched or strict:
        hint = (" -- is this snapshot of another model or config?" if mismatched else
                "; pass strict=False to load the rest (missing tensors keep their values)")
        raise ValueError(text + hint)
    warnings.warn(text + "; the missing tensors keep their current values", stacklevel=3)
