"""Redistributing DTensors held as strided shards (a fused q/k/v weight split by heads),
also on PyTorch versions whose DTensor cannot.

A strided shard (``_StridedShard(dim, split_factor)``) reads its dim as ``split_factor``
pieces and holds this rank's block of each. PyTorch 2.13's ``redistribute`` and
``full_tensor`` handle one alone on a mesh axis; 2.11's do not (they try to read it as a
shard order and raise ``ValueError``: "... unable to be interpreted into a corresponding
shard_order"), which broke checkpoints and gathers of such models there. ``redistribute``
here asks DTensor first and, where it refuses, gathers the strided axes with the runtime's
own strided all-gather, lets DTensor do the rest, and takes strided blocks locally. A
nested strided shard (``(_StridedShard(d, k), Shard(d))``: dim ``d`` split on the later
axes first and on this one within each piece, as Alpa's ``prefer_reduce_scatter`` stores
a column-parallel bias on a 2D mesh) is gathered there as a plain shard of a rank's
piece; 2.13's DTensor handles it to and from whole and plain shards, not to a lone
strided shard, which this does. A stacked strided shard (``(_StridedShard(d, k),
_StridedShard(d, k))``: the k pieces split by the axes in order, a fused q/k/v split by
heads over both axes of a 2D mesh) is always moved here: 2.13's DTensor lays it out
right but gathers it wrong, silently (its ``full_tensor`` of a (2, 2) one mixes the
pieces); its axes are gathered inner first, each a lone strided shard's gather.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate

from torchalpa.core.placement import is_shard, split_factor_of, stacked_strided
from torchalpa.runtime.execution.collectives import (
    all_gather,
    all_gather_strided,
    local_chunk,
    local_split_factor,
)

__all__ = ["redistribute", "full_value", "full_tensor"]


def _strided(placements: Sequence) -> bool:
    return any(split_factor_of(p) > 1 for p in placements)


def redistribute(t: DTensor, placements: Sequence) -> DTensor:
    """``t`` on its mesh with ``placements``, a collective like ``DTensor.redistribute``
    (every rank of the mesh calls it)."""
    mesh, placements = t.device_mesh, tuple(placements)
    if not (_strided(t.placements) or _strided(placements)):
        return t.redistribute(mesh, placements)
    shape = tuple(mesh.shape)
    if any(stacked_strided(side, a, shape) for side in (tuple(t.placements), placements)
           for a in range(len(side))):
        return _by_hand(t, placements)      # DTensor would gather it wrong
    try:
        return t.redistribute(mesh, placements)
    except ValueError:            # PyTorch 2.11: a lone strided shard is not understood
        pass
    except RuntimeError:          # 2.13: a nested one to a lone one fails a check
        if not any(_nested(side, a, shape) for side in (tuple(t.placements), placements)
                   for a in range(len(side))):
            raise
    return _by_hand(t, placements)


def _by_hand(t: DTensor, placements: tuple) -> DTensor:
    """``redistribute`` without DTensor's strided shards: the strided axes gathered by the
    runtime's collectives (a nested strided shard, on a rank's piece, as a plain shard:
    ``collectives.local_split_factor``), DTensor for the rest, strided blocks taken
    locally."""
    mesh = t.device_mesh
    shape = tuple(mesh.shape)
    for side in (t.placements, placements):
        for axis, p in enumerate(side):
            if is_shard(p) and split_factor_of(p) > 1 and not _nested(side, axis, shape) \
                    and not stacked_strided(side, axis, shape) \
                    and any(other != axis and is_shard(q) and q.dim == p.dim
                            for other, q in enumerate(side)):
                raise NotImplementedError(
                    f"redistributing {tuple(t.placements)} -> {placements}: a strided shard "
                    "sharing its dim with another mesh axis, other than nested inside the "
                    "later axes' shards of it or stacked with the same split factor, needs "
                    "PyTorch >= 2.13")
    local, now = t.to_local(), list(t.placements)
    for axis in reversed(range(len(now))):      # inner axes first (a stacked one's order)
        p = now[axis]
        if is_shard(p) and split_factor_of(p) > 1:
            pieces = local_split_factor(now, axis, shape)
            group = mesh.get_group(axis).group_name
            local = all_gather_strided(local, p.dim, mesh.size(axis), group, pieces) \
                if pieces > 1 else all_gather(local, p.dim, mesh.size(axis), group)
            now[axis] = Replicate()
    plain = [Replicate() if split_factor_of(q) > 1 else q for q in placements]
    middle = DTensor.from_local(local, mesh, now, shape=t.shape, stride=t.stride())
    local = middle.redistribute(mesh, plain).to_local()
    coords = mesh.get_coordinate()
    assert coords is not None, "this rank is not in the tensor's mesh"
    for axis, q in enumerate(placements):
        if is_shard(q) and split_factor_of(q) > 1:
            local = local_chunk(local, q.dim, mesh.size(axis), coords[axis],
                                local_split_factor(placements, axis, shape))
    return DTensor.from_local(local, mesh, placements, shape=t.shape, stride=t.stride())


def _nested(placements: Sequence, axis: int, mesh_shape: tuple) -> bool:
    """A strided shard nested inside the later axes' plain shards of its dim."""
    p = placements[axis]
    if not is_shard(p) or split_factor_of(p) == 1:
        return False
    later = [b for b in range(len(placements)) if b != axis and is_shard(placements[b])
             and placements[b].dim == p.dim]
    if any(b < axis or split_factor_of(placements[b]) > 1 for b in later):
        return False
    try:
        return local_split_factor(placements, axis, mesh_shape) == 1
    except ValueError:
        return False


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor on every rank (``DTensor.full_tensor``, strided shards
    included); a plain tensor as it is."""
    if not isinstance(t, DTensor):
        return t
    return redistribute(t, [Replicate()] * t.device_mesh.ndim).to_local()


full_tensor = full_value
"""``torchalpa.full_tensor``: the public name of ``full_value``, for a user's own gathers
(logging, comparing, a hand-written checkpoint)."""
