"""Vocabulary-parallel embedding lookups at run time (Megatron's vocab-parallel embedding).

``passes/rules/embedding.py`` lets the planner split an embedding table by rows (the
vocabulary dim ``V``). The indices stay global row numbers, so a device holding rows
``[offset, offset + V_local)`` must translate them, and rows it does not own contribute
nothing there:

- the lookup reads ``weight[index - offset]`` where the row is local and writes zeros
  elsewhere; summed over the devices that split ``V`` (the result is ``Partial``), every
  position holds its one row, as on one device;
- the dense gradient of the table scatters each incoming gradient row into its local row;
  rows owned elsewhere go to one spare row past the block, dropped afterwards, so that
  ``scale_grad_by_freq`` still counts each row's own lookups, and ``padding_idx`` is
  translated like an index (-1 when another device owns it).

The same translation serves ``gather`` and ``scatter*`` along a split dim (the target pick
of a vocab-parallel cross entropy, and its backward's scatter of the target gradient):

- ``gather_block`` picks where this block owns the position and writes zeros elsewhere
  (a Partial sum of the global gather);
- ``scatter_block`` writes (or adds, or reduces) only the positions this block owns;
  the others go to one spare slot past the block, dropped afterwards.

``runtime.lowering.localize`` rewrites ``aten.embedding`` / ``aten.embedding_dense_backward`` calls
whose table is split into calls of ``lookup`` / ``dense_backward``, and gathers / scatters
whose addressed dim is split into ``gather_block`` / ``scatter_block``, with this rank's
``offset`` baked in (``row_offset``).
"""

from __future__ import annotations

import torch

from torchalpa.core.placement import Shard

__all__ = ["row_offset", "lookup", "dense_backward", "gather_block", "scatter_block"]

aten = torch.ops.aten


def row_offset(rows: int, dim: int, placements, mesh_shape, coords) -> tuple[int, int]:
    """(first global row, row count) of the block of a dim of ``rows`` rows that the rank at
    ``coords`` holds; axes shard it in mesh order, the first one major (as DTensor does)."""
    offset, size = 0, rows
    for axis, p in enumerate(placements):
        if isinstance(p, Shard) and p.dim == dim:
            size //= mesh_shape[axis]
            offset += int(coords[axis]) * size
    return offset, size


def _local_indices(indices: torch.Tensor, offset: int, rows: int, spare: int):
    """(indices into the block, mask of the lookups the block owns); others -> ``spare``."""
    local = indices - offset
    owned = (local >= 0) & (local < rows)
    return torch.where(owned, local, torch.full_like(local, spare)), owned


def lookup(weight: torch.Tensor, indices: torch.Tensor, offset: int, padding_idx: int = -1,
           scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
    """``aten.embedding`` on the rows ``[offset, offset + len(weight))`` of the table: zeros
    where another device owns the row (a Partial sum of the global lookup)."""
    local, owned = _local_indices(indices, offset, weight.shape[0], 0)
    out = aten.embedding.default(weight, local, -1, scale_grad_by_freq, sparse)
    return out * owned.unsqueeze(-1).to(out.dtype)


def dense_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, offset: int,
                   padding_idx: int = -1, scale_grad_by_freq: bool = False) -> torch.Tensor:
    """``aten.embedding_dense_backward`` for the ``num_weights`` rows from ``offset``."""
    local, _ = _local_indices(indices, offset, num_weights, num_weights)
    local_padding = padding_idx - offset \
        if padding_idx >= 0 and 0 <= padding_idx - offset < num_weights else -1
    full = aten.embedding_dense_backward.default(grad, local, num_weights + 1, local_padding,
                                                 scale_grad_by_freq)
    return full[:num_weights]


def gather_block(block: torch.Tensor, dim: int, index: torch.Tensor, offset: int,
                 sparse_grad: bool = False) -> torch.Tensor:
    """``aten.gather`` of global positions from the block ``[offset, offset + size)`` of
    ``dim``: zeros where another device owns the position (a Partial sum)."""
    local, owned = _local_indices(index, offset, block.shape[dim], 0)
    picked = aten.gather.default(block, dim, local, sparse_grad=sparse_grad)
    return torch.where(owned, picked, torch.zeros_like(picked))


def scatter_block(op: str, block: torch.Tensor, dim: int, index: torch.Tensor, offset: int,
                  *rest, **kwargs) -> torch.Tensor:
    """``aten.<op>`` (a scatter overload, ``"scatter.value"``) of global positions into the
    block ``[offset, offset + size)`` of ``dim``: positions owned elsewhere land in a
    spare slot past the block, which is dropped."""
    packet, overload = op.split(".")
    size = block.shape[dim]
    spare_shape = list(block.shape)
    spare_shape[dim] = 1
    padded = torch.cat([block, block.new_zeros(spare_shape)], dim=dim)
    local, _ = _local_indices(index, offset, size, size)
    out = getattr(getattr(aten, packet), overload)(padded, dim, local, *rest, **kwargs)
    return out.narrow(dim, 0, size)
