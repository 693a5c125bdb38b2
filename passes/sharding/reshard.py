"""The one redistribution planner: which collectives turn one layout into another.

Works axis by axis like DTensor's redistribute. Reductions and gathers run first, from
the innermost mesh axis out (so a dim split over two axes is reassembled in the right
order); then shards that a collective can produce directly (reduce-scatter, all-to-all);
then local steps: slices, outermost axis first, and Replicate -> Partial, where the rank
at coordinate 0 keeps the value and the others hold zeros (exact, free: it lets a whole
value join a sum of partial ones, reduced once). Shard -> Partial is impossible (None).
Each step records the bytes each rank contributes.

A strided shard (``placement.strided``: a device's block of each of k pieces of the dim)
is gathered, reduce-scattered into and sliced to like a shard of the same dim (the
runtime reorders the pieces locally); it never takes part in an all-to-all, so moving
between it and another split goes through a gather.

A shard that an all-to-all could turn into another but for an outer axis splitting the
target dim, which the target leaves whole (``(S(0), S(1)) -> (R, S(0))``: axis 0 splits
dim 0 in the way of axis 1's move), is gathered on that outer axis first and then moved
by the all-to-all, instead of gathered on both axes and sliced, when that is no dearer
on any mesh axis whatever its latency and bandwidth (``_cheaper_on_every_axis``): on
(2, 2) the outer gather moves half the bytes and the all-to-all costs what the inner
gather did. Alpa's prefer_reduce_scatter rewrite reads a weight stored so (its conv net
with mixed mesh shapes on (2, 2)) this way.

A *nested* strided shard (``nested_strided``) is DTensor's ``(_StridedShard(d, k),
Shard(d))`` on a 2D mesh with k devices on axis 1 (FSDP over tensor parallelism): the
dim split on axis 1 first and on axis 0 within each piece. Axis 0's split is then the
innermost one: it is gathered first (without undoing axis 1's), and a partial sum on
axis 0 reduce-scatters straight into it; on each rank's block (axis 1's piece) those are
a plain shard's collectives (``collectives.local_split_factor``). Alpa's
``prefer_reduce_scatter`` stores a column-parallel bias so (``gradient_scatter.py``).

A *stacked* strided shard (``placement.stacked_strided``) is the other nesting: every axis that
splits the dim holds a strided shard with the same ``split_factor`` k, DTensor's
``(_StridedShard(d, k), _StridedShard(d, k))`` read left to right: the k pieces
outermost, each split on axis 0 and each of those blocks on axis 1, as a fused (3, H)
q/k/v is split by heads over both axes of a 2D mesh (separate q, k and v are
``(Shard(0), Shard(0))`` each). It nests like a plain multi-axis split (inner axes
gathered first, outer axes sliced and reduce-scattered into first), each step a lone
strided shard's on a rank's block; the ILP offers it (``strategies._strided_alone``).
"""

from __future__ import annotations

from functools import lru_cache

from torchalpa.core.collective_math import alpha_beta_seconds
from torchalpa.core.opgraph import TensorSpec
from torchalpa.core.placement import (
    KIND_OF_TYPE,
    Placements,
    Replicate,
    is_partial,
    is_replicate,
    is_shard,
    kind_of,
    split_factor_of,
    stacked_strided,
)
from torchalpa.core.plan import ReshardStep

__all__ = ["plan_reshard", "local_bytes", "nested_strided"]


def local_bytes(spec: TensorSpec, placements: Placements, mesh_shape) -> int:
    n = spec.nbytes
    for axis, p in enumerate(placements):
        if (KIND_OF_TYPE.get(type(p)) or kind_of(p)) == "shard":    # is_shard, called often
            n //= mesh_shape[axis]
    return n


def _divisor(placements: Placements, mesh_shape) -> int:
    """What ``local_bytes`` divides a tensor's bytes by (floor dividing by each factor in
    turn is floor dividing by their product)."""
    d = 1
    for axis, p in enumerate(placements):
        if is_shard(p):
            d *= mesh_shape[axis]
    return d


def nested_strided(placements: Placements, axis: int, mesh_shape) -> bool:
    """Whether ``placements[axis]`` is a strided shard nested inside the later axes' plain
    shards of its dim: its ``split_factor`` is the number of pieces they cut the dim into
    (DTensor's ``(_StridedShard(d, k), Shard(d))``), so on this rank's block it is a plain
    shard."""
    p = placements[axis]
    if not is_shard(p) or split_factor_of(p) == 1:
        return False
    later = [(b, q) for b, q in enumerate(placements)
             if b != axis and is_shard(q) and q.dim == p.dim]
    if not later or any(b < axis or split_factor_of(q) != 1 for b, q in later):
        return False
    outer = 1
    for b, _ in later:
        outer *= mesh_shape[b]
    return outer == split_factor_of(p)


def _scatters_into_nested(cur, dst, axis: int, mesh_shape) -> bool:
    """A partial sum on ``axis`` reduce-scatters straight into ``dst[axis]``, a nested
    strided shard whose enclosing splits ``cur`` already has."""
    if not nested_strided(dst, axis, mesh_shape):
        return False
    dim = dst[axis].dim
    return all(cur[b] == dst[b] for b in range(len(cur))
               if b != axis and any(is_shard(p) and p.dim == dim for p in (cur[b], dst[b])))


def _scatters_inside_outer(cur, dst, axis: int, mesh_shape) -> bool:
    """A partial sum on ``axis`` reduce-scatters straight into ``dst[axis]``, a plain
    shard of a dim that only outer axes split otherwise, each of them staying as it is:
    the scatter splits each of their pieces, which is the nesting order of a multi-axis
    split (``(Shard(0), Partial) -> (Shard(0), Shard(0))``, as DTensor does it). An inner
    axis still a partial sum scatters after it, inside its pieces. A stacked strided shard
    (``stacked_strided``) nests the same way: its scatter is a strided one on the block."""
    d = dst[axis]
    stacked = stacked_strided(dst, axis, mesh_shape)
    if split_factor_of(d) != 1 and not stacked:
        return False
    for b in range(len(cur)):
        if b == axis or not any(is_shard(p) and p.dim == d.dim for p in (cur[b], dst[b])):
            continue
        if b > axis and is_partial(cur[b]):
            continue        # an inner partial sum scattering later, inside these pieces
        if b > axis or cur[b] != dst[b] or (split_factor_of(cur[b]) != 1 and not stacked):
            return False
    return True


def _all_to_all_direct(cur, dst, axis: int, src_dim: int, dim: int) -> bool:
    """Whether one all-to-all on ``axis`` turns blocks of ``src_dim`` into blocks of ``dim``
    although other axes split those dims too: ``axis`` must be the innermost split of
    ``src_dim`` (joining the received blocks then rebuilds the outer axes' block), and every
    other split of ``dim`` an outer one that stays (this axis's chunks of the local block
    are then the innermost split, as the nesting order wants). Tokens split over both axes
    of a 2D mesh reach experts split over the inner one this way (Alpa's MoE on (2, 2)),
    where gathering and slicing would cost an all-gather."""
    if any(is_shard(p) and p.dim == src_dim for p in cur[axis + 1:]):
        return False
    for b in range(len(cur)):
        if b == axis:
            continue
        splits = any(is_shard(p) and p.dim == dim for p in (cur[b], dst[b]))
        if splits and (b > axis or cur[b] != dst[b]):
            return False
    return True


def _outer_blockers(cur, dst, axis: int, src_dim: int, dim: int) -> tuple[int, ...]:
    """The outer axes whose plain split of ``dim`` alone keeps an all-to-all on ``axis``
    from moving ``src_dim``'s blocks into ``dim``'s, each of them whole in ``dst`` (so
    gathered anyway): gathered first, the all-to-all is direct. Empty if none or if
    gathering them would not make it so."""
    blockers = tuple(b for b in range(axis)
                     if is_shard(cur[b]) and cur[b].dim == dim and is_replicate(dst[b])
                     and split_factor_of(cur[b]) == 1)
    if not blockers:
        return ()
    after = list(cur)
    for b in blockers:
        after[b] = Replicate()
    return blockers if _all_to_all_direct(after, dst, axis, src_dim, dim) else ()


def _axis_costs(moves, mesh_shape) -> list[tuple[int, float]]:
    """Per mesh axis: how many collectives ``moves`` issue on it, and their bandwidth
    term (seconds at inverse bandwidth 1, for a tensor of 1 byte)."""
    out = [(0, 0.0)] * len(mesh_shape)
    for kind, axis, _, _, _, divisor in moves:
        n = mesh_shape[axis]
        if n > 1 and kind not in ("slice", "partition"):
            count, seconds = out[axis]
            out[axis] = (count + 1, seconds + alpha_beta_seconds(kind, n, 1 / divisor, 0, 1))
    return out


def _cheaper_on_every_axis(new, old, mesh_shape) -> bool:
    """Whether ``new`` moves cost no more than ``old`` for every latency and bandwidth
    of the mesh axes (no more collectives and no more bandwidth term on any axis), and
    less on some."""
    a, b = _axis_costs(new, mesh_shape), _axis_costs(old, mesh_shape)
    eps = 1e-12
    return all(ca <= cb and sa <= sb + eps for (ca, sa), (cb, sb) in zip(a, b)) \
        and any(ca < cb or sa < sb - eps for (ca, sa), (cb, sb) in zip(a, b))


@lru_cache(maxsize=1 << 16)
def plan_reshard(spec: TensorSpec, src: Placements, dst: Placements,
                 mesh_shape: tuple[int, ...], allow_reduce_scatter: bool = True,
                 allow_all_to_all: bool = True) -> tuple[ReshardStep, ...] | None:
    """Steps from ``src`` to ``dst`` (empty if equal), or None if no steps can do it.

    Without ``allow_reduce_scatter`` a Partial becomes a Shard by all-reduce and slice
    (Alpa's default search space, where only an option enables reduce-scatter). Without
    ``allow_all_to_all`` no all-to-all replaces a gather and slice the planner would
    otherwise take (one that moves a shard straight into another is still listed: the
    caller refuses it). The moves depend on the layouts alone (``_moves``, found once
    per pair); ``spec`` only gives each step its bytes."""
    if src == dst:
        return ()
    moves = _moves(src, dst, tuple(mesh_shape), allow_reduce_scatter, allow_all_to_all)
    if moves is None:
        return None
    nbytes = spec.nbytes
    return tuple(ReshardStep(kind=kind, axis=axis, bytes=nbytes // divisor, src=before,
                             dst=after, **kw)
                 for kind, axis, before, after, kw, divisor in moves)


@lru_cache(maxsize=1 << 16)
def _moves(src: Placements, dst: Placements, mesh_shape: tuple[int, ...],
           allow_reduce_scatter: bool, allow_all_to_all: bool = True) -> tuple | None:
    """``plan_reshard``'s steps without their bytes: (kind, axis, layout before, layout
    after, the step's other fields, what the tensor's bytes are divided by before it)
    each, or None if no steps can do it. Where an outer gather lets an all-to-all
    replace gathers and a slice, the cheaper of both on every axis
    (``_cheaper_on_every_axis``)."""
    plain = _walk(src, dst, mesh_shape, allow_reduce_scatter, False)
    if plain is None or not allow_all_to_all:
        return plain
    early = _walk(src, dst, mesh_shape, allow_reduce_scatter, True)
    if early is not None and early != plain and _cheaper_on_every_axis(early, plain, mesh_shape):
        return early
    return plain


def _walk(src: Placements, dst: Placements, mesh_shape: tuple[int, ...],
          allow_reduce_scatter: bool, gather_outer_first: bool) -> tuple | None:
    """``_moves``' steps, walking the axes; ``gather_outer_first``: gather the outer
    axes in the way of an all-to-all first (``_outer_blockers``)."""
    if len(src) != len(mesh_shape) or len(dst) != len(mesh_shape):
        raise ValueError(f"placements {src} -> {dst} do not match mesh {mesh_shape}")
    for s, d in zip(src, dst):
        if is_partial(d) and s != d and not is_replicate(s):
            return None
    steps: list[tuple] = []
    cur = list(src)

    def emit(kind, axis, new, **kw):
        before = tuple(cur)
        cur[axis] = new
        steps.append((kind, axis, before, tuple(cur), kw, _divisor(before, mesh_shape)))

    def gather(axis):
        # Reassemble inner axes that split the same dim first, so nesting order holds
        # (a nested strided shard is the innermost split itself).
        p = cur[axis]
        nested = nested_strided(tuple(cur), axis, mesh_shape)
        for inner in range(len(cur) - 1, axis, -1):
            if not nested and is_shard(cur[inner]) and cur[inner].dim == p.dim:
                gather(inner)
        emit("all_gather", axis, Replicate(), dim=p.dim)

    # 0. partial sums that scatter inside outer splits, outer axes first (an inner axis
    #    still summing scatters later, inside this one's pieces)
    for axis in range(len(cur)):
        if allow_reduce_scatter and is_partial(cur[axis]) and is_shard(dst[axis]) \
                and _scatters_inside_outer(cur, dst, axis, mesh_shape):
            emit("reduce_scatter", axis, dst[axis], dim=dst[axis].dim,
                 reduce_op=cur[axis].reduce_op)
    # 1. reductions and gathers, inner axes first
    for axis in reversed(range(len(cur))):
        s, d = cur[axis], dst[axis]
        if s == d or is_replicate(s):
            continue
        if is_partial(s):
            if is_shard(d) and allow_reduce_scatter \
                    and (_scatters_into_nested(cur, dst, axis, mesh_shape)
                         or _scatters_inside_outer(cur, dst, axis, mesh_shape)):
                emit("reduce_scatter", axis, d, dim=d.dim, reduce_op=s.reduce_op)
            else:
                emit("all_reduce", axis, Replicate(), reduce_op=s.reduce_op)
        elif is_shard(s):
            plain = is_shard(d) and split_factor_of(s) == split_factor_of(d) == 1
            blockers = _outer_blockers(cur, dst, axis, s.dim, d.dim) \
                if plain and gather_outer_first else ()
            for b in reversed(blockers):
                if is_shard(cur[b]):
                    gather(b)
            if plain and _all_to_all_direct(cur, dst, axis, s.dim, d.dim):
                emit("all_to_all", axis, d, dim=d.dim, src_dim=s.dim)
            else:
                gather(axis)
    # 2. local steps: a whole value becomes a partial sum (coordinate 0 keeps it, the
    #    others hold zeros: exact), and slices, outer axes first (the nesting order of a
    #    multi-axis split)
    for axis in range(len(cur)):
        if is_replicate(cur[axis]) and is_partial(dst[axis]):
            emit("partition", axis, dst[axis], reduce_op=dst[axis].reduce_op)
    for axis in range(len(cur)):
        if cur[axis] != dst[axis]:
            if not is_replicate(cur[axis]) or not is_shard(dst[axis]):
                return None
            for inner in range(len(cur) - 1, axis, -1):  # an inner split of this dim must
                if cur[inner] == dst[axis]:              # be undone before the outer one
                    gather(inner)
            emit("slice", axis, dst[axis], dim=dst[axis].dim)
    assert tuple(cur) == tuple(dst), (src, dst, cur)
    return tuple(steps)
