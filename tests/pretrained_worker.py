"""Launched on 2 plain ranks by tests/test_pretrained.py: for each snapshot, a freshly
initialized MLP, planned with ZeRO-3 (every parameter sharded), loads it with
``load_pretrained``; each rank writes, per snapshot, its loss and how many elements it read
to ``<out>/rank<r>.json``. Several snapshots share one launch (the processes' start-up is
most of its time).

    pretrained_worker.py OUT SNAPSHOT [SNAPSHOT ...]
"""

from __future__ import annotations

import json
import os
import sys

import safetensors
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from models import MLP, FusedAttention, fused_attention_by_heads, fused_inputs, mlp_inputs  # noqa: E402,E501

import torchalpa  # noqa: E402
from torchalpa.runtime.execution.mesh import init_distributed  # noqa: E402

READ = {"elements": 0}


class _CountingFile:
    """safetensors' file handle, counting the elements each read returns."""

    def __init__(self, *args, **kwargs):
        self._file = _real_safe_open(*args, **kwargs)

    def keys(self):
        return self._file.keys()

    def get_tensor(self, key):
        t = self._file.get_tensor(key)
        READ["elements"] += t.numel()
        return t

    def get_slice(self, key):
        return _CountingSlice(self._file.get_slice(key))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CountingSlice:
    def __init__(self, view):
        self._view = view

    def get_shape(self):
        return self._view.get_shape()

    def __getitem__(self, index):
        t = self._view[index]
        READ["elements"] += t.numel()
        return t


_real_safe_open = safetensors.safe_open
safetensors.safe_open = _CountingFile


def load_one(snapshot: str) -> dict:
    """A fresh ZeRO-3 plan of the MLP loads ``snapshot``: its loss, the elements read."""
    READ["elements"] = 0
    torch.manual_seed(1)                       # not the snapshot's weights
    if "fused" in os.path.basename(snapshot):   # c_attn a strided shard: heads of q, k, v
        x, y = fused_inputs()
        pm = torchalpa.auto_parallel(FusedAttention(), (x, y), F.mse_loss,
                                     method=fused_attention_by_heads(dist.get_world_size()))
    else:
        x, y = mlp_inputs(8, 16)
        pm = torchalpa.auto_parallel(MLP(16, 3), (x, y), F.mse_loss,
                                     method=torchalpa.Zero3Parallel())
    info = torchalpa.load_pretrained(pm, snapshot)
    loss = pm(x, y).item()
    total = sum(p.numel() for p in pm.parameters())
    return {"loss": loss, "read": READ["elements"], "total": total, **info}


def main():
    out, snapshots = sys.argv[1], sys.argv[2:]
    init_distributed()
    seen = {snapshot: load_one(snapshot) for snapshot in snapshots}
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(seen, f)
    dist.barrier()
    dist.destroy_process_group()
    # Written and left the group: skip interpreter teardown, where gloo threads can abort
    # the process ("terminate called without an active exception"; see worker_io.finish)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
