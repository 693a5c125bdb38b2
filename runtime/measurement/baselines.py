"""Hand-written baselines to compare against: DDP and FSDP2 (fully_shard)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from torchalpa.core.cluster import cuda_selected

__all__ = ["wrap_ddp", "wrap_fsdp2", "batch_shard"]


def wrap_ddp(model: nn.Module) -> nn.Module:
    """DistributedDataParallel on this rank's device."""
    if cuda_selected():
        device = torch.cuda.current_device()
        return DistributedDataParallel(model.to(device), device_ids=[device])
    return DistributedDataParallel(model)


def wrap_fsdp2(model: nn.Module, mesh=None) -> nn.Module:
    """FSDP2 as torchtitan applies it: each layer of a layer stack (the members of every
    ``nn.ModuleList`` / ``nn.Sequential`` that hold parameters) sharded as one group, then
    the root for the rest. A layer sharing a parameter with a module outside it (a tied
    embedding) stays in the root's group, as FSDP2 requires."""
    from torch.distributed.fsdp import fully_shard
    owners: dict[int, set[int]] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(m))
    layers = []     # chosen before any is sharded (sharding replaces the parameters)
    for stack in [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]:
        for layer in stack:
            inside = {id(m) for m in layer.modules()}
            params = list(layer.parameters())
            if params and all(owners[id(p)] <= inside for p in params):
                layers.append(layer)
    for layer in reversed(layers):      # nested stacks: the inner layers first
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch_shard(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's slice of a global batch (what a DistributedSampler would give it)."""
    if x.shape[0] % world_size:
        raise ValueError(f"batch of {x.shape[0]} does not divide over {world_size} ranks")
    size = x.shape[0] // world_size
    return x[rank * size:(rank + 1) * size]
