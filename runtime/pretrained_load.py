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

Collective only in that every rank must call it (no communication happens).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from torchalpa.core import placement as P
from torchalpa.runtime.collectives import local_chunk

__all__ = ["load_pretrained", "snapshot_files"]

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
            hint = (f"; it has {', '.join(found[:5])}: pass one file's path" if found
                    else " (a PyTorch .bin snapshot? convert it to safetensors first)")
            raise FileNotFoundError(f"{path} holds neither {SINGLE} nor {INDEX}{hint}")
    if not path.is_file():
        raise FileNotFoundError(f"no safetensors snapshot at {os.fspath(path)!r}")
    if path.name.endswith(".json"):
        return _indexed_files(path)
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: path for key in f.keys()}
    except Exception as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from e


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
        if P.is_shard(p) and P.split_factor_of(p) > 1:
            block = local_chunk(block, p.dim, tensor.device_mesh.size(axis), coords[axis],
                                P.split_factor_of(p))
    return block


@torch.no_grad()
def load_pretrained(pm, path: str | os.PathLike, *, strict: bool = True) -> dict[str, list[str]]:
    """Fill ``pm``'s parameters and persistent buffers from the safetensors snapshot at
    ``path``, each rank reading only its blocks (see the module docstring). Returns
    ``{"missing_keys": [...], "unexpected_keys": [...]}`` as HuggingFace does."""
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

    from safetensors import safe_open
    handles = {}
    mismatched, reads = [], []
    for first, key in found.items():
        if key is None:
            continue
        file = files[key]
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        view = handles[file].get_slice(key)
        tensor = state[first]
        saved_shape = tuple(view.get_shape())
        if saved_shape != tuple(tensor.shape):
            mismatched.append(f"{key}: the snapshot has shape {list(saved_shape)}, the "
                              f"model {list(tensor.shape)}")
            continue
        if isinstance(tensor, DTensor) and any(p.is_partial() for p in tensor.placements):
            raise NotImplementedError(f"{first} is a partial sum across ranks "
                                      f"({tensor.placements}); cannot load a value into it")
        reads.append((tensor, handles[file], view, key))
    _report(type(module).__name__, path, missing, unexpected, mismatched, strict)
    for tensor, handle, view, key in reads:
        offset, shape = _block(tensor)
        block = (view[tuple(slice(o, o + s) for o, s in zip(offset, shape))] if shape
                 else handle.get_tensor(key))
        block = _strided_part(tensor, block)
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        assert tuple(block.shape) == tuple(local.shape), (key, block.shape, local.shape)
        local.copy_(block)
    return {"missing_keys": missing, "unexpected_keys": unexpected}


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
