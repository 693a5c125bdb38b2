"""The collectives a local program calls, one small function per plan step kind.

Each collective is defined once, as an *issue* half (start the functional collective of
``torch.distributed`` (``_c10d_functional``), which the process group runs in the
background) and a *finish* half (wait for it and lay the result out). The blocking
version a lowered program calls is ``finish(issue(...))``; ``runtime.rewrites.overlap`` splits it
into its two halves so the wait moves to the first use. A local program is thus plain
ATen ops plus these calls: printable, traceable, and counted by ``runtime.measurement.comm_count``.
Each issue half also reports to ``runtime.measurement.traffic`` (the bytes ``pm.last_step_stats()``
measures, and the labels of a profiler's timeline).
Inputs are made contiguous first, as the collectives require. While memory is measured,
each half also tells ``runtime.measurement.settle`` what it handed over and waited for, so
that the collective's tensors are freed on this thread, where the profiler sees it.

``step_call`` maps one plan step (``plan.ReshardStep``) to its function and arguments,
which the lowering emits into a graph (and tests call eagerly).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from torchalpa.core.placement import is_shard, split_factor_of, stacked_strided
from torchalpa.core.plan import ReshardStep
from torchalpa.runtime.measurement.settle import settle, track, uses_before
from torchalpa.runtime.measurement.traffic import issued, wait_label

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "local_chunk",
           "local_partition", "issue_all_reduce", "finish_all_reduce", "issue_all_gather",
           "finish_all_gather", "issue_reduce_scatter", "finish_reduce_scatter",
           "issue_all_to_all", "finish_all_to_all", "SPLIT", "Split", "step_call",
           "all_gather_strided", "reduce_scatter_strided",
           "finish_all_gather_strided", "issue_reduce_scatter_strided",
           "issue_all_gather_strided", "local_split_factor"]

_c10d = torch.ops._c10d_functional


# -- issue / finish halves ----------------------------------------------------------------

def issue_all_reduce(x: torch.Tensor, reduce_op: str, group_name: str, *,
                     in_place: bool = False) -> torch.Tensor:
    """Start reducing ``x`` across ranks. ``in_place``: into ``x`` itself, when the program
    made ``x`` for this collective alone (a gradient bucket's flat buffer): no copy of it;
    not while ``torch.compile`` traces the program (AOTAutograd cannot functionalize the
    in-place collective: a pipeline stage's compiled ``reduce_grads`` failed on it)."""
    with issued("all_reduce", x, group_name):
        if in_place and x.is_contiguous() and not torch.compiler.is_compiling():
            return track(x, uses_before(x), _c10d.all_reduce_(x, reduce_op, group_name))
        x = x.contiguous()
        return track(x, uses_before(x), _c10d.all_reduce(x, reduce_op, group_name))


def finish_all_reduce(handle: torch.Tensor) -> torch.Tensor:
    with wait_label("all_reduce"):
        out = _c10d.wait_tensor(handle)
    settle(out)
    return out


def issue_all_gather(x: torch.Tensor, dim: int, group_size: int, group_name: str
                     ) -> torch.Tensor:
    """Start gathering every rank's block (stacked along dim 0 by the collective)."""
    del dim   # the blocks are moved to ``dim`` by the finish half
    x = x.contiguous()
    with issued("all_gather", x, group_name, received_factor=group_size):
        return track(x, uses_before(x),
                     _c10d.all_gather_into_tensor(x, group_size, group_name))


def finish_all_gather(handle: torch.Tensor, dim: int, group_size: int) -> torch.Tensor:
    """Wait, then concatenate the ranks' blocks along ``dim``."""
    with wait_label("all_gather"):
        out = _c10d.wait_tensor(handle)
    settle(out)
    return out if dim == 0 else torch.cat(torch.chunk(out, group_size, dim=0), dim=dim)


def issue_reduce_scatter(x: torch.Tensor, dim: int, reduce_op: str, group_size: int,
                         group_name: str) -> torch.Tensor:
    """Start reducing across ranks, each keeping its block of ``dim``."""
    if dim != 0:
        x = torch.cat(torch.chunk(x, group_size, dim=dim), dim=0)
    x = x.contiguous()
    with issued("reduce_scatter", x, group_name, received_factor=1 / group_size):
        return track(x, uses_before(x),
                     _c10d.reduce_scatter_tensor(x, reduce_op, group_size, group_name))


def finish_reduce_scatter(handle: torch.Tensor) -> torch.Tensor:
    with wait_label("reduce_scatter"):
        out = _c10d.wait_tensor(handle)
    settle(out)
    return out


def issue_all_to_all(x: torch.Tensor, src_dim: int, dim: int, group_size: int,
                     group_name: str) -> torch.Tensor:
    """Start moving from blocks of ``src_dim`` to blocks of ``dim``: split ``dim``, exchange."""
    del src_dim   # the received blocks are joined along it by the finish half
    send = torch.cat(torch.chunk(x, group_size, dim=dim), dim=0).contiguous()
    splits = [send.shape[0] // group_size] * group_size
    with issued("all_to_all", send, group_name):
        return track(send, uses_before(send),
                     _c10d.all_to_all_single(send, splits, splits, group_name))


def finish_all_to_all(handle: torch.Tensor, src_dim: int, group_size: int) -> torch.Tensor:
    """Wait, then join the received blocks along ``src_dim``."""
    with wait_label("all_to_all"):
        recv = _c10d.wait_tensor(handle)
    settle(recv)
    return torch.cat(torch.chunk(recv, group_size, dim=0), dim=src_dim)


# -- strided shards: the same collectives, the pieces reordered locally ---------------------
# A strided shard (``placement.strided(dim, k)``) holds this rank's block of each of the
# dim's ``k`` pieces. Read the dim as (k, n, m): the rank at coordinate r holds [:, r, :].

def _swap_blocks(x: torch.Tensor, dim: int, outer: int, inner: int) -> torch.Tensor:
    """Dim ``dim`` read as (outer, inner, m), reordered as (inner, outer, m): a whole dim
    (k, n, m) to each rank's strided block contiguous (n, k, m), or the ranks' gathered
    blocks (n, k, m) back in piece order (k, n, m)."""
    m = x.shape[dim] // (outer * inner)
    return x.unflatten(dim, (outer, inner, m)).transpose(dim, dim + 1).flatten(dim, dim + 2)


def issue_all_gather_strided(x: torch.Tensor, dim: int, group_size: int, group_name: str,
                             split_factor: int) -> torch.Tensor:
    """Start a strided shard's gather: the blocks travel as a shard's do."""
    del split_factor   # the finish half puts the pieces in order
    return issue_all_gather(x, dim, group_size, group_name)


def finish_all_gather_strided(handle: torch.Tensor, dim: int, group_size: int,
                              split_factor: int) -> torch.Tensor:
    """Wait, then put every rank's block of each piece in its place."""
    return _swap_blocks(finish_all_gather(handle, dim, group_size), dim, group_size,
                        split_factor)


def issue_reduce_scatter_strided(x: torch.Tensor, dim: int, reduce_op: str, group_size: int,
                                 group_name: str, split_factor: int) -> torch.Tensor:
    """Start reducing, each rank keeping its block of each piece of ``dim``."""
    return issue_reduce_scatter(_swap_blocks(x, dim, split_factor, group_size), dim,
                                reduce_op, group_size, group_name)


def all_gather_strided(x: torch.Tensor, dim: int, group_size: int, group_name: str,
                       split_factor: int) -> torch.Tensor:
    """A strided shard's ``all_gather``: the whole dim, pieces in order."""
    return finish_all_gather_strided(
        issue_all_gather_strided(x, dim, group_size, group_name, split_factor), dim,
        group_size, split_factor)


def reduce_scatter_strided(x: torch.Tensor, dim: int, reduce_op: str, group_size: int,
                           group_name: str, split_factor: int) -> torch.Tensor:
    """``reduce_scatter`` into a strided shard of ``dim``."""
    return finish_reduce_scatter(
        issue_reduce_scatter_strided(x, dim, reduce_op, group_size, group_name, split_factor))


# -- blocking versions: finish(issue(...)) -------------------------------------------------

def all_reduce(x: torch.Tensor, reduce_op: str, group_name: str, *,
               in_place: bool = False) -> torch.Tensor:
    return finish_all_reduce(issue_all_reduce(x, reduce_op, group_name, in_place=in_place))


def all_gather(x: torch.Tensor, dim: int, group_size: int, group_name: str) -> torch.Tensor:
    """Concatenate every rank's block along ``dim``."""
    return finish_all_gather(issue_all_gather(x, dim, group_size, group_name), dim, group_size)


def reduce_scatter(x: torch.Tensor, dim: int, reduce_op: str, group_size: int,
                   group_name: str) -> torch.Tensor:
    """Reduce across ranks and keep this rank's block of ``dim``."""
    return finish_reduce_scatter(
        issue_reduce_scatter(x, dim, reduce_op, group_size, group_name))


def all_to_all(x: torch.Tensor, src_dim: int, dim: int, group_size: int,
               group_name: str) -> torch.Tensor:
    """From blocks of ``src_dim`` to blocks of ``dim``: split ``dim``, exchange, join ``src_dim``."""
    return finish_all_to_all(issue_all_to_all(x, src_dim, dim, group_size, group_name),
                             src_dim, group_size)


class Split(NamedTuple):
    """A blocking collective's halves and which of its arguments the finish half takes
    after the handle (by position in the blocking call's arguments, input first)."""

    issue: Callable[..., torch.Tensor]
    finish: Callable[..., torch.Tensor]
    finish_args: tuple[int, ...]


SPLIT: dict[Callable[..., torch.Tensor], Split] = {
    all_reduce: Split(issue_all_reduce, finish_all_reduce, ()),
    all_gather: Split(issue_all_gather, finish_all_gather, (1, 2)),
    reduce_scatter: Split(issue_reduce_scatter, finish_reduce_scatter, ()),
    all_to_all: Split(issue_all_to_all, finish_all_to_all, (1, 3)),
    all_gather_strided: Split(issue_all_gather_strided, finish_all_gather_strided, (1, 2, 4)),
    reduce_scatter_strided: Split(issue_reduce_scatter_strided, finish_reduce_scatter, ()),
}


# -- local steps (no communication) ---------------------------------------------------------

def local_partition(x: torch.Tensor, index: int, reduce_op: str) -> torch.Tensor:
    """A replicated value as a partial one: summing over the axis gives it back exactly
    (the rank at coordinate 0 keeps it, the others hold zeros); an average, a max or a
    min of copies is the value itself."""
    if reduce_op in ("avg", "max", "min") or index == 0:
        return x
    return torch.zeros_like(x)


def local_chunk(x: torch.Tensor, dim: int, num_chunks: int, index: int,
                split_factor: int = 1) -> torch.Tensor:
    """This rank's block of a replicated tensor (no communication); with a
    ``split_factor``, its block of each of that many pieces (a strided shard).

    The block is contiguous, as DTensor's local shards are: a view of a dim after the
    first is not, and some kernels compute wrong results on such views without saying so
    (torch 2.13's CPU ``native_layer_norm_backward`` with a sliced ``mean``/``rstd`` gives
    a wrong weight gradient; ``tests/test_local_chunk.py``)."""
    if split_factor > 1:
        m = x.shape[dim] // (split_factor * num_chunks)
        return x.unflatten(dim, (split_factor, num_chunks, m)).select(dim + 1, index).flatten(
            dim, dim + 1).contiguous()
    size = x.shape[dim] // num_chunks
    return x.narrow(dim, index * size, size).contiguous()


# -- plan steps ------------------------------------------------------------------------------

def local_split_factor(placements: Sequence, axis: int, mesh_shape: Sequence[int]) -> int:
    """How many pieces of this rank's block ``placements[axis]`` splits: a strided shard's
    ``split_factor`` counts the pieces the later axes' shards of its dim cut it into too
    (DTensor's ``(_StridedShard(d, k), Shard(d))``: axis 1 splits the dim first, axis 0
    within each of its k pieces), and those pieces are not in this rank's block. 1: a
    plain shard of the block (the nested strided shard whose enclosing splits are all
    there). A stacked strided shard (every axis splitting the dim strided with the same
    k, ``(_StridedShard(d, k), _StridedShard(d, k))``: the pieces split by the axes in
    order) splits k pieces of the block its outer axes leave, whatever the axis. A
    ``split_factor`` that the later splits do not divide is no layout this runtime lays
    out: ``ValueError``."""
    p = placements[axis]
    factor = split_factor_of(p)
    if factor == 1:
        return 1
    if stacked_strided(placements, axis, mesh_shape):
        return factor
    outer = 1
    for b in range(axis + 1, len(placements)):
        q = placements[b]
        if is_shard(q) and q.dim == p.dim:
            if split_factor_of(q) != 1:
                outer = 0
                break
            outer *= mesh_shape[b]
    if outer == 0 or factor % outer:
        raise ValueError(
            f"the runtime cannot lay out {tuple(placements)}: mesh axis {axis}'s strided "
            f"shard of dim {p.dim} (split_factor {factor}) is not its pieces times the later "
            "axes' plain shards of that dim, nor stacked with the other axes' strided shards "
            "of it; re-plan with this version of torchalpa")
    return factor // outer


def _inner_splits_left(placements: Sequence, axis: int, mesh_shape: Sequence[int]) -> bool:
    """A stacked strided shard on ``axis`` with a later axis still splitting its dim: a
    step on ``axis`` there would read the pieces in the wrong order (inner axes are
    gathered first and sliced last)."""
    k = split_factor_of(placements[axis])
    dim = getattr(placements[axis], "dim", None)
    return k > 1 and any(mesh_shape[b] > 1 and is_shard(q) and q.dim == dim
                         and split_factor_of(q) == k
                         for b, q in enumerate(placements) if b > axis)


def step_call(step: ReshardStep, mesh_shape: Sequence[int], coords: Sequence[int],
              group_names: Sequence[str]) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    """The function that runs ``step`` on this rank (at mesh coordinate ``coords``) and
    its arguments after the tensor: what the lowering emits."""
    n, group = mesh_shape[step.axis], group_names[step.axis]
    # pieces of this rank's block: a nested strided shard's steps are a plain shard's
    layout = step.src if step.kind == "all_gather" else step.dst
    pieces = local_split_factor(layout, step.axis, mesh_shape)
    if _inner_splits_left(layout, step.axis, mesh_shape):
        raise ValueError(f"the runtime cannot run a {step.kind} on mesh axis {step.axis} of "
                         f"{tuple(layout)} while a later axis splits that dim: re-plan with "
                         "this version of torchalpa")
    if step.kind == "all_reduce":
        return all_reduce, (step.reduce_op, group)
    if step.kind == "all_gather":
        if pieces > 1:
            return all_gather_strided, (step.dim, n, group, pieces)
        return all_gather, (step.dim, n, group)
    if step.kind == "reduce_scatter":
        if pieces > 1:
            return reduce_scatter_strided, (step.dim, step.reduce_op, n, group, pieces)
        return reduce_scatter, (step.dim, step.reduce_op, n, group)
    if step.kind == "all_to_all":
        return all_to_all, (step.src_dim, step.dim, n, group)
    if step.kind == "slice":
        if pieces > 1:
            return local_chunk, (step.dim, n, coords[step.axis], pieces)
        return local_chunk, (step.dim, n, coords[step.axis])
    if step.kind == "partition":
        return local_partition, (coords[step.axis], step.reduce_op)
    raise ValueError(f"the runtime cannot execute a {step.kind!r} step; the plan's steps must "
                     "be collectives or local slice / partition steps (re-plan with this "
                     "version of torchalpa)")

