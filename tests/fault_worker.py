"""Launched as plain processes by tests/test_faults_dist.py (no torchrun agent to stop the
survivors): one rank is SIGKILLed at a chosen moment, and every survivor writes what it
saw to ``<out>/rank<r>.json``.

    fault_worker.py OUT step  VICTIM             # killed before its second training step
    fault_worker.py OUT save  VICTIM POINT       # killed at POINT of the second save
    fault_worker.py OUT hang  VICTIM             # hung in a sleep instead of its second step
    fault_worker.py OUT stuck VICTIM             # in a receive nobody sends, instead
    fault_worker.py OUT.json flip -1             # a flipped byte, found by every rank

``hang`` and ``stuck`` kill no rank: the victim is alive but never reaches the step, so
the others time out and fail, and the victim's heartbeat has to stop it. ``stuck``
receives on a group with an hour's timeout, so no error of its own can end it first.

``save`` first saves a good checkpoint under ``OUT/ckpt`` after one step and writes the
full weights it holds (``OUT/old.pt``) and those after the second step (``OUT/new.pt``),
so the test can check which one a later load finds. ``flip`` kills no rank: it runs on the
rank pool (``worker_io.launch``), its checkpoints beside ``OUT.json``, where rank 0 writes
every rank's report.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from worker_io import finish  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.runtime.execution.mesh import init_distributed  # noqa: E402
from torchalpa.runtime.state import checkpoint as ck  # noqa: E402


def build():
    """The model the test loads into as well (same names and shapes)."""
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def never_return(mode: str, long_group) -> None:
    """The victim of ``hang`` or ``stuck``: wait for what never comes."""
    if mode == "hang":
        time.sleep(3600)
    peer = 1 if dist.get_rank() == 0 else 0
    dist.recv(torch.zeros(1), src=peer, group=long_group)   # nobody sends


def flip_and_load(out: str, pm, rank: int) -> dict:
    """Two saves; rank 0 flips one byte of rank 1's shard of the newer; every rank loads:
    all must refuse it naming the file, then fall back to the older one when asked."""
    import warnings
    path = os.path.join(out, "ckpt")
    ck.save_checkpoint(path, pm)
    old = [p.full_tensor().clone() for p in pm.parameters()]
    pm.train_step(*batch())
    newest = ck.save_checkpoint(path, pm)
    if rank == 0:
        shard = newest / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    result: dict = {}
    try:
        ck.load_checkpoint(path, pm)
        result["refused"] = None
    except ck.CheckpointError as e:
        result["refused"] = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result["loaded"] = ck.load_checkpoint(path, pm, fallback=True).name
    result["warned"] = [str(w.message) for w in caught]
    result["old_weights"] = all(torch.equal(a, p.full_tensor()) for a, p in
                                zip(old, pm.parameters()))
    return result


def flip_on_every_rank(out_json: str, pm, rank: int) -> None:
    """``flip_and_load`` (or the error it raised) on each rank; rank 0 writes them all."""
    seen: dict = {"rank": rank}
    try:
        seen.update(flip_and_load(os.path.dirname(out_json), pm, rank))
        seen["error"] = None
    except Exception as e:  # what the test checks
        seen["error"] = f"{type(e).__name__}: {e}"
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    finish({"ranks": everyone}, out_json)


def main():
    out, mode, victim = sys.argv[1], sys.argv[2], int(sys.argv[3])
    init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    n = dist.get_world_size()
    pm = torchalpa.auto_parallel(build(), batch(), F.mse_loss,
                                 cluster=torchalpa.LogicalMesh(shape=(n,), alpha=(1.0,),
                                                               beta=(1.0,)),
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                 method=torchalpa.ShardParallel())
    pm.train_step(*batch())
    if mode == "flip":
        return flip_on_every_rank(out, pm, rank)
    long_group = dist.new_group(timeout=datetime.timedelta(hours=1)) if mode == "stuck" \
        else None
    seen: dict = {"rank": rank}
    start = time.monotonic()
    try:
        if mode in ("step", "hang", "stuck"):
            if rank == victim:
                die() if mode == "step" else never_return(mode, long_group)
            pm.train_step(*batch())
        else:
            point = sys.argv[4]
            path = os.path.join(out, "ckpt")
            ck.save_checkpoint(path, pm)
            old = [p.full_tensor().clone() for p in pm.parameters()]
            pm.train_step(*batch())
            new = [p.full_tensor().clone() for p in pm.parameters()]
            if rank == 0:
                torch.save({"old": old, "new": new}, os.path.join(out, "weights.pt"))
            dist.barrier()
            if rank == victim:
                ck._fault_hook = lambda reached: die() if reached == point else None
            ck.save_checkpoint(path, pm)
        seen["error"] = None
    except Exception as e:  # what the test checks
        seen["error"] = f"{type(e).__name__}: {e}"
    seen["seconds"] = time.monotonic() - start
    seen["ended_at"] = time.time()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
