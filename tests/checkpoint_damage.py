"""Bad files planted in a saved checkpoint where ``load_checkpoint`` reads them late, and a
record of everything a load may change, to show that a refused load changed nothing.

Each plant rewrites the manifest to match the damaged file (sizes and SHA-256), so the
checksums pass and the damage is found only when the file is read -- after the other
files of the checkpoint have been read:

- ``rng``: rank r's ``rng-<r>.pt`` holds a tensor that is no generator state;
- ``optimizer``: the last optimizer-state item (by offset) of rank r's DCP shard file
  is overwritten with zeros;
- ``shard``: rank r's whole DCP shard file is overwritten with zeros.

``Versioned`` is a layer whose ``set_extra_state`` refuses a state saved in a newer
format than it reads (set ``reads_up_to`` lower to make it refuse).

Used by tests/test_faults_checkpoint.py (one process) and tests/load_refusal_worker.py
(4 gloo ranks).
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

KINDS = ("rng", "optimizer", "shard")


class Versioned(nn.Linear):
    """A layer with extra state that checks what it loads, as a layer recording its format
    would: it refuses a state saved by a newer format than it reads; otherwise it takes
    the saved ``scale``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.format, self.reads_up_to, self.scale = 2, 2, 1.0

    def get_extra_state(self):
        return {"format": self.format, "scale": self.scale}

    def set_extra_state(self, state):
        if state["format"] > self.reads_up_to:
            raise ValueError(f"saved in format {state['format']}; this layer reads formats "
                             f"up to {self.reads_up_to}")
        self.scale = state["scale"]


def reseal(version: Path) -> None:
    """Rewrite the manifest's sizes and checksums to match the files."""
    path = version / "MANIFEST.json"
    manifest = json.loads(path.read_text())
    for name, entry in manifest["files"].items():
        data = (version / name).read_bytes()
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    path.write_text(json.dumps(manifest))


def plant(version: Path, kind: str, rank: int) -> str:
    """Damage ``kind`` (one of ``KINDS``) in rank ``rank``'s files of the checkpoint
    ``version`` and reseal the manifest; the name of the damaged file."""
    if kind == "rng":
        name = f"rng-{rank}.pt"
        torch.save({"cpu": torch.zeros(16, dtype=torch.uint8)}, version / name)
    else:
        name = f"__{rank}_0.distcp"
        data = bytearray((version / name).read_bytes())
        if kind == "shard":
            start, length = 0, len(data)
        elif kind == "optimizer":
            start, length = _last_item(version, name, "optimizer.")
        else:
            raise ValueError(f"unknown damage {kind!r}; one of {KINDS}")
        data[start:start + length] = bytes(length)
        (version / name).write_bytes(bytes(data))
    reseal(version)
    return name


def _last_item(version: Path, name: str, prefix: str) -> tuple[int, int]:
    """Offset and length of the last item of file ``name`` whose key starts with
    ``prefix`` (DCP's metadata, read with DCP's own trusting reader: a test's file)."""
    metadata = FileSystemReader(version).read_metadata()
    items = [(info.offset, info.length) for index, info in metadata.storage_data.items()
             if info.relative_path == name and index.fqn.startswith(prefix)]
    assert items, f"{name} holds no {prefix}* item"
    return max(items)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def held_state(pm) -> dict:
    """What a load may change, by name: this rank's parameters, buffers and modules' extra
    state, the optimizer's state and hyperparameters, the random state and the step counter."""
    held: dict = {f"model {name}": _local(t) if isinstance(t, torch.Tensor) else copy.deepcopy(t)
                  for name, t in pm.state_dict().items()}        # extra state: as it is
    optimizer = pm.optimizer.state_dict()
    for index, entries in optimizer["state"].items():
        for key, value in entries.items():
            held[f"optimizer state {index}.{key}"] = _local(value) \
                if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    for index, group in enumerate(optimizer["param_groups"]):
        for key, value in group.items():
            held[f"optimizer group {index}.{key}"] = copy.deepcopy(value)
    held["random state"] = torch.get_rng_state()
    held["step counter"] = pm._num_calls
    return held


def differences(now: dict, before: dict) -> list[str]:
    """The names whose values are not bit-identical (or that only one side has)."""
    return [name for name in sorted(set(now) | set(before))
            if name not in now or name not in before or not _same(now[name], before[name])]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    return a == b
