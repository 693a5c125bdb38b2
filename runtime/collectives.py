"""The collectives a local program calls, one small function per plan step kind.

Each wraps a functional collective of ``torch.distributed`` (``_c10d_functional``) and
waits for it, so a local program is plain ATen ops plus these calls: printable,
traceable, and counted by ``runtime.comm_count``. Inputs are made contiguous first,
as the collectives require.
"""

from __future__ import annotations

import torch

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "local_chunk",
           "local_partition"]

_c10d = torch.ops._c10d_functional


def all_reduce(x: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), reduce_op, group_name))


def all_gather(x: torch.Tensor, dim: int, group_size: int, group_name: str) -> torch.Tensor:
    """Concatenate every rank's block along ``dim``."""
    out = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous(), group_size, group_name))
    if dim == 0:
        return out
    return torch.cat(torch.chunk(out, group_size, dim=0), dim=dim)


def reduce_scatter(x: torch.Tensor, dim: int, reduce_op: str, group_size: int,
                   group_name: str) -> torch.Tensor:
    """Reduce across ranks and keep this rank's block of ``dim``."""
    if dim != 0:
        x = torch.cat(torch.chunk(x, group_size, dim=dim), dim=0)
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(x.contiguous(), reduce_op, group_size,
                                                         group_name))


def all_to_all(x: torch.Tensor, src_dim: int, dim: int, group_size: int,
               group_name: str) -> torch.Tensor:
    """From blocks of ``src_dim`` to blocks of ``dim``: split ``dim``, exchange, join ``src_dim``."""
    send = torch.cat(torch.chunk(x, group_size, dim=dim), dim=0).contiguous()
    splits = [send.shape[0] // group_size] * group_size
    recv = _c10d.wait_tensor(_c10d.all_to_all_single(send, splits, splits, group_name))
    return torch.cat(torch.chunk(recv, group_size, dim=0), dim=src_dim)


def local_partition(x: torch.Tensor, index: int, reduce_op: str) -> torch.Tensor:
    """A replicated value as a partial one: summing over the axis gives it back exactly
    (the rank at coordinate 0 keeps it, the others hold zeros); an average is itself."""
    if reduce_op == "avg" or index == 0:
        return x
    return torch.zeros_like(x)


def local_chunk(x: torch.Tensor, dim: int, num_chunks: int, index: int) -> torch.Tensor:
    """This rank's block of a replicated tensor (no communication)."""
    size = x.shape[dim] // num_chunks
    return x.narrow(dim, index * size, size)
