"""On gloo ranks (tests/test_faults_checkpoint_dist.py): a checkpoint whose last rank has a
bad file read late (tests/checkpoint_damage.py) is refused on every rank, and no rank's
model, optimizer, random state or step counter changed; the good checkpoint then loads
bit-identically.

    load_refusal_worker.py OUT.json

The model is ZeRO-3 sharded with Adam, so every rank's shard file holds its own part of
the parameters and of the optimizer state. Rank 0 writes every rank's findings to OUT.json
(the checkpoints go beside it).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from checkpoint_damage import KINDS, differences, held_state, plant  # noqa: E402
from worker_io import attempt, finish  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.runtime.execution.mesh import gather_objects, init_distributed  # noqa: E402
from torchalpa.runtime.state.checkpoint import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402


def build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    return torchalpa.auto_parallel(model, batch(), F.mse_loss, method=torchalpa.Zero3Parallel(),
                                   optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def refused(pm, good: Path, bad_root: Path, kind: str, victim: int) -> dict:
    """Load a copy of ``good`` with ``kind`` planted in rank ``victim``'s files: the error
    this rank raised and what of its state changed."""
    if dist.get_rank() == 0:
        shutil.copytree(good.parent, bad_root)
        plant(bad_root / good.name, kind, victim)
    dist.barrier()
    held = held_state(pm)
    try:
        load_checkpoint(bad_root, pm)
        error = None
    except CheckpointError as e:
        error = str(e)
    return {"error": error, "changed": differences(held_state(pm), held)}


def main():
    out = Path(sys.argv[1])
    init_distributed()
    victim = dist.get_world_size() - 1
    fresh = build(seed=1)                      # its optimizer has no state yet
    pm = build(seed=0)
    pm.train_step(*batch())
    good = save_checkpoint(out.parent / "good", pm)
    saved = held_state(pm)
    pm.train_step(*batch())
    torch.rand(3)                              # the random state moves on from the save
    results: dict = {}
    for kind in KINDS:
        results[kind] = attempt(lambda: refused(pm, good, out.parent / kind, kind, victim))
    results["fresh optimizer"] = attempt(
        lambda: refused(fresh, good, out.parent / "fresh", "optimizer", victim))
    load_checkpoint(good, pm)
    results["good"] = {"changed": differences(held_state(pm), saved)}
    finish({"ranks": gather_objects(results)}, str(out))


if __name__ == "__main__":
    main()
