"""Out of torchalpa: the trained model as a plain module, or a HuggingFace checkpoint.

``gathered_module(pm)`` gathers every DTensor parameter and buffer of a ParallelModule to
its full tensor (a collective: every rank must call it) and returns a deep copy of the
user's module holding those plain tensors -- no DTensors, no torchalpa -- so HuggingFace's
``generate()``, ``torch.save`` or any single-device code works on it. Tied weights stay
tied (one gathered tensor for both names). A pipeline's stages hold their tensors on
their own submeshes: each tensor is gathered over its stage's ranks, then broadcast from
that stage's first rank, so every rank gets the whole model.

``save_pretrained(pm, directory)`` writes that module from rank 0: with the model's own
``save_pretrained`` (HuggingFace: config plus consolidated ``model.safetensors``, tied
weights stored once, loadable by ``from_pretrained``), else ``model.safetensors`` through
``safetensors.torch.save_model`` (which also stores shared tensors once).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchalpa.runtime.execution.mesh import rank, world_size
from torchalpa.runtime.lowering.strided_dtensor import full_value

__all__ = ["gathered_module", "save_pretrained"]


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t`` on every rank: gathered over its mesh, then, when that mesh is
    one pipeline stage's submesh, broadcast from its first rank to the ranks outside it."""
    if not isinstance(t, DTensor) or t.device_mesh.size() == world_size():
        return full_value(t)
    owners = t.device_mesh.mesh.flatten().tolist()
    if rank() in owners:
        whole = full_value(t).contiguous()
    else:   # this rank is not in the stage: its local tensor is empty, on the right device
        whole = torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
    dist.broadcast(whole, src=owners[0])
    return whole


@torch.no_grad()
def gathered_module(pm) -> nn.Module:
    """A plain copy of ``pm``'s module with full (gathered) tensors; call on every rank."""
    module = getattr(pm, "module", None)
    if not isinstance(module, nn.Module) or not hasattr(pm, "plan"):
        raise TypeError(f"expected a torchalpa ParallelModule, got {type(pm).__name__}")
    memo: dict[int, object] = {}
    for _, p in module.named_parameters(remove_duplicate=True):
        memo[id(p)] = nn.Parameter(_full(p).detach().clone(), requires_grad=p.requires_grad)
    for _, b in module.named_buffers(remove_duplicate=True):
        memo[id(b)] = _full(b).detach().clone()
    plain = copy.deepcopy(module, memo)
    for name, t in list(plain.named_parameters()) + list(plain.named_buffers()):
        assert not isinstance(t, DTensor), f"{name} is still a DTensor after gathering"
    return plain


def save_pretrained(pm, directory: str | os.PathLike, **kwargs) -> None:
    """Gather ``pm`` (every rank calls this) and write it to ``directory`` from rank 0.

    ``kwargs`` go to the model's own ``save_pretrained`` (HuggingFace models).
    """
    plain = gathered_module(pm)
    if rank() == 0:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_pretrained = getattr(plain, "save_pretrained", None)
        if callable(save_pretrained):
            save_pretrained(directory, safe_serialization=True, **kwargs)
        else:
            if kwargs:
                raise TypeError(f"{type(plain).__name__} has no save_pretrained; options "
                                f"{sorted(kwargs)} cannot be honoured")
            from safetensors.torch import save_model
            save_model(plain, str(directory / "model.safetensors"))
    if world_size() > 1:
        dist.barrier()          # nobody reads the directory before rank 0 has written it
