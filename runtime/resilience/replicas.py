"""Check that every replica of a replicated value is bitwise the same on every rank.

Replicated parameters stay equal only while every rank computes the same thing: the same
gradients, the same optimizer step, and the same random numbers where replicas draw them.
A random call made on some ranks only, or per-rank seeding after ``auto_parallel``, makes
replicas drift silently: every rank still reports the same loss. This check turns that
into an error naming the value: each rank hashes the bits of its blocks (and its random
generator state), the ranks of each mesh axis gather the hashes (one small all-gather per
axis), and a value replicated over that axis whose hashes differ is named with the ranks
that disagree. It runs at the start of every step with ``auto_parallel(...,
check_replicas=True)`` or ``TORCHALPA_CHECK_REPLICAS=1``, or on demand with
``ParallelModule.check_replicas()``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from torchalpa.runtime.execution.mesh import comm_device, gather_objects

__all__ = ["ReplicaMismatchError", "bit_hash", "check_replicas", "enabled_by_env",
           "raise_on_every_rank", "RNG_STATE"]

RNG_STATE = "the default random generator state (torch.get_rng_state())"
CUDA_RNG_STATE = "the device's random generator state (torch.cuda.get_rng_state())"
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaMismatchError(RuntimeError):
    """Copies of a replicated value differ across ranks."""


def enabled_by_env() -> bool:
    return os.environ.get("TORCHALPA_CHECK_REPLICAS", "0") not in ("", "0")


def bit_hash(t: torch.Tensor) -> torch.Tensor:
    """An int64 hash of ``t``'s bits (shape included): equal tensors hash equal, and a
    change of any element changes it (up to 64-bit collisions)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    weights = weights * 0x9E3779B1 % (2 ** 61 - 1) + 1   # spread positions
    shape = torch.tensor(list(t.shape) + [len(t.shape)], dtype=torch.int64, device=bits.device)
    return (bits * weights).sum() + shape.sum() * 0x632BE5AB   # wraps on overflow: fine


def check_replicas(named: list[tuple[str, torch.Tensor]], mesh, *, check_rng: bool = True,
                   device: torch.device | None = None) -> None:
    """Raise ``ReplicaMismatchError`` on every rank if a replicated value differs.

    ``named``: (name, tensor) pairs; a DTensor is checked over the mesh axes it is
    replicated on, a plain tensor over every axis. ``check_rng`` adds the default CPU
    generator's state, which every rank must share (``runtime/lowering/random_draws.py``), and on a CUDA
    ``device`` that device's generator state.
    """
    if mesh.size() == 1:
        return
    comm = comm_device()
    entries = []   # (name, axes it is replicated over, hash)
    for name, t in named:
        if isinstance(t, DTensor):
            axes = [a for a, p in enumerate(t.placements) if isinstance(p, Replicate)]
            t = t.to_local()
        else:
            axes = list(range(mesh.ndim))
        entries.append((name, axes, bit_hash(t).to(comm)))
    if check_rng:
        state = bit_hash(torch.get_rng_state()).to(comm)
        entries.append((RNG_STATE, list(range(mesh.ndim)), state))
        if device is not None and device.type == "cuda":
            state = bit_hash(torch.cuda.get_rng_state(device)).to(comm)
            entries.append((CUDA_RNG_STATE, list(range(mesh.ndim)), state))
    problems = []
    for axis in range(mesh.ndim):
        if mesh.size(axis) == 1:
            continue
        mine = [(name, h) for name, axes, h in entries if axis in axes]
        if not mine:
            continue
        group = mesh.get_group(axis)
        local = torch.stack([h for _, h in mine])
        everyone = [torch.empty_like(local) for _ in range(mesh.size(axis))]
        dist.all_gather(everyone, local, group=group)
        ranks = dist.get_process_group_ranks(group)
        table = torch.stack(everyone).cpu().tolist()  # (ranks on the axis, values)
        for j, (name, _) in enumerate(mine):
            differ = [ranks[i] for i in range(len(ranks)) if table[i][j] != table[0][j]]
            if differ:
                problems.append(f"{name}: replicated over mesh axis {axis} "
                                f"({mesh.mesh_dim_names[axis] if mesh.mesh_dim_names else axis}), "
                                f"ranks {differ} differ from rank {ranks[0]}")
    if problems:
        shown = "\n  ".join(problems[:10]) + ("\n  ..." if len(problems) > 10 else "")
        raise ReplicaMismatchError(
            f"copies of replicated values differ across ranks:\n  {shown}\n"
            "Replicas drift when ranks draw different random numbers (a random call made on "
            "some ranks only after auto_parallel, or torch.manual_seed / set_rng_state with "
            "per-rank values: give per-rank randomness its own torch.Generator) or when the "
            "model or optimizer is changed on some ranks only. Training on would diverge "
            "silently; restore from a checkpoint, or re-wrap with auto_parallel, which "
            "synchronizes the ranks again.")


def raise_on_every_rank(error: ReplicaMismatchError | None) -> None:
    """Raise ``error``, or the first error another rank found, on every rank (one small
    all-gather of the messages). A pipeline's stages check replicas on their own meshes; a
    stage that stopped alone would leave the others waiting for its activations."""
    everyone = gather_objects(None if error is None else str(error))
    if error is not None:
        raise error
    found = next(((r, m) for r, m in enumerate(everyone) if m is not None), None)
    if found is not None:
        raise ReplicaMismatchError(f"on rank {found[0]}'s pipeline stage: {found[1]}")
