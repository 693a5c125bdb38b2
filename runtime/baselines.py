"""Hand-written baselines to compare against: DDP and FSDP2 (fully_shard)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["wrap_ddp", "wrap_fsdp2", "batch_shard"]


def wrap_ddp(model: nn.Module) -> nn.Module:
    """DistributedDataParallel on this rank's device."""
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        return DistributedDataParallel(model.to(device), device_ids=[device])
    return DistributedDataParallel(model)


def wrap_fsdp2(model: nn.Module, mesh=None) -> nn.Module:
    """FSDP2: every child module with parameters sharded on its own, then the root."""
    from torch.distributed.fsdp import fully_shard
    for child in model.modules():
        if child is not model and any(True for _ in child.parameters(recurse=False)):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch_shard(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's slice of a global batch (what a DistributedSampler would give it)."""
    if x.shape[0] % world_size:
        raise ValueError(f"batch of {x.shape[0]} does not divide over {world_size} ranks")
    size = x.shape[0] // world_size
    return x[rank * size:(rank + 1) * size]
