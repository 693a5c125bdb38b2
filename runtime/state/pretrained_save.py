"""Out of torchalpa: the trained model as a plain module, or a HuggingFace checkpoint.

``gathered_module(pm)`` gathers every DTensor parameter and buffer of a ParallelModule to
its full tensor (a collective: every rank must call it) and returns a deep copy of the
user's module holding those plain tensors -- no DTensors, no torchalpa -- so HuggingFace's
``generate()``, ``torch.save`` or any single-device code works on it. Tied weights stay
tied (one gathered tensor for both names). Every rank gets the whole model (what
``pm.unwrap()`` promises): a pipeline's stages hold their tensors on their own submeshes,
so each tensor is gathered over its stage's ranks, then broadcast from that stage's first
rank.

``save_pretrained(pm, directory)`` writes the model from rank 0, and only rank 0 holds it:
tensor by tensor, each is gathered over its mesh (that mesh's ranks hold it whole until the
next one) and, when rank 0 is not in that mesh (another pipeline stage's), sent to rank 0 by
the mesh's first rank; the other ranks keep nothing. Rank 0 writes with the model's own
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


WRITER = 0
"""The rank that writes ``save_pretrained``'s files, and the only one that holds the model."""


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


def _to_writer(t: torch.Tensor) -> torch.Tensor | None:
    """The whole of ``t`` on rank ``WRITER``, None on the others: gathered over its mesh
    (whose ranks hold it whole until they drop it), then, when the writer is not in that
    mesh (another pipeline stage's submesh), sent to it by the mesh's first rank."""
    if not isinstance(t, DTensor):
        return t if rank() == WRITER else None
    owners = t.device_mesh.mesh.flatten().tolist()
    whole = full_value(t).contiguous() if rank() in owners else None
    if WRITER in owners:
        return whole if rank() == WRITER else None
    if whole is not None and rank() == owners[0]:
        dist.send(whole, dst=WRITER)
    elif rank() == WRITER:
        whole = torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
        dist.recv(whole, src=owners[0])
        return whole
    return None


def _module_of(pm) -> nn.Module:
    module = getattr(pm, "module", None)
    if not isinstance(module, nn.Module) or not hasattr(pm, "plan"):
        raise TypeError(f"expected a torchalpa ParallelModule, got {type(pm).__name__}")
    return module


@torch.no_grad()
def _plain_copy(module: nn.Module, whole, *, keep: bool) -> nn.Module | None:
    """A deep copy of ``module`` holding ``whole(t)`` for each parameter and buffer ``t``
    (called for each in the same order on every rank: it may be a collective); None where
    not ``keep`` (what ``whole`` gave there is dropped at once)."""
    memo: dict[int, object] = {}
    for _, p in module.named_parameters(remove_duplicate=True):
        value = whole(p)
        if keep:
            memo[id(p)] = nn.Parameter(value.detach().clone(), requires_grad=p.requires_grad)
    for _, b in module.named_buffers(remove_duplicate=True):
        value = whole(b)
        if keep:
            memo[id(b)] = value.detach().clone()
    if not keep:
        return None
    plain = copy.deepcopy(module, memo)
    for name, t in list(plain.named_parameters()) + list(plain.named_buffers()):
        assert not isinstance(t, DTensor), f"{name} is still a DTensor after gathering"
    return plain


def gathered_module(pm) -> nn.Module:
    """A plain copy of ``pm``'s module with full (gathered) tensors, on every rank; call on
    every rank."""
    plain = _plain_copy(_module_of(pm), _full, keep=True)
    assert plain is not None
    return plain


def save_pretrained(pm, directory: str | os.PathLike, **kwargs) -> None:
    """Gather ``pm`` to rank 0 (every rank calls this) and write it to ``directory`` there;
    the other ranks hold nothing of it beyond one tensor at a time.

    ``kwargs`` go to the model's own ``save_pretrained`` (HuggingFace models).
    """
    module = _module_of(pm)
    if kwargs and not callable(getattr(module, "save_pretrained", None)):   # on every rank
        raise TypeError(f"{type(module).__name__} has no save_pretrained; options "
                        f"{sorted(kwargs)} cannot be honoured")
    plain = _plain_copy(module, _to_writer, keep=rank() == WRITER)
    if plain is not None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_pretrained = getattr(plain, "save_pretrained", None)
        if callable(save_pretrained):
            save_pretrained(directory, safe_serialization=True, **kwargs)
        else:
            from safetensors.torch import save_model
            save_model(plain, str(directory / "model.safetensors"))
    if world_size() > 1:
        dist.barrier()          # nobody reads the directory before rank 0 has written it
