"""Where a step of one micro-batch packs each gradient's bucket, as the runtime forms them.

The runtime reduces gradients in buckets (``runtime/rewrites/buckets.py``,
``gradient_buckets``): in backward's order (the reverse of the parameters'), gradients of
one element size join the open bucket while its bytes stay within the cap (DDP's: 1 MiB
for the first bucket, 25 MiB after it; the plan's ``all_reduce_threshold`` for every
bucket where set), else open the next. With one micro-batch the bucket is packed (one flat
buffer of all its members) right after its last member is made
(``runtime/rewrites/reduce_in_backward.py``): there the packed buffer is alive beside the
members it copies, so that point holds every member's bytes once more
(``memory.Liveness.transient_of``).

Priced from the graph alone, before the plan is known: each gradient's bytes as the op
that makes it lays it out whole (a ZeRO or data-parallel plan's raw gradient, a partial sum
whole on each device); the runtime forms buckets from the plan's local bytes and keeps
gradients of different collectives (axis, reduce op, scattered dim) apart, so a plan that
also splits gradients over a tensor-parallel axis packs more of them per bucket than
priced here.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchalpa.core.cluster import GRADIENT_BUCKET_BYTES

__all__ = ["FIRST_BUCKET_BYTES", "bucket_members", "packing_points"]

FIRST_BUCKET_BYTES = 2 ** 20
"""DDP's first bucket (``runtime.rewrites.buckets.FIRST_BUCKET_BYTES``): where the cap is
DDP's default, the first bucket of each element size holds at most this."""


def bucket_members(sizes: Sequence[tuple[int, int]],
                   bucket_bytes: float = GRADIENT_BUCKET_BYTES) -> list[list[int]]:
    """The runtime's buckets of gradients of ``sizes`` (per gradient, in the parameters'
    order: its bytes, its element size), each a list of indices into ``sizes`` in the
    order they are packed; ``bucket_bytes``: the cap (0: each gradient alone)."""
    if bucket_bytes <= 0:
        return [[i] for i in reversed(range(len(sizes)))]
    first_cap = min(FIRST_BUCKET_BYTES, bucket_bytes) \
        if bucket_bytes == GRADIENT_BUCKET_BYTES else bucket_bytes
    open_bucket: dict[int, list[int]] = {}     # element size -> members of its open bucket
    opened: dict[int, int] = {}                # element size -> buckets opened so far
    buckets: list[list[int]] = []
    for i in reversed(range(len(sizes))):     # backward's order
        nbytes, itemsize = sizes[i]
        members = open_bucket.get(itemsize)
        cap = first_cap if opened.get(itemsize, 0) == 1 else bucket_bytes
        if members is None or sum(sizes[j][0] for j in members) + nbytes > cap:
            members = open_bucket[itemsize] = []
            opened[itemsize] = opened.get(itemsize, 0) + 1
            buckets.append(members)
        members.append(i)
    return buckets


def packing_points(made: Sequence[tuple[int, int, int]],
                   bucket_bytes: float = GRADIENT_BUCKET_BYTES) -> list[int]:
    """The point where each gradient's bucket is packed. ``made``: per gradient, in the
    parameters' order, (the point its op makes it, its bytes, its element size);
    ``bucket_bytes``: the cap (0: no buckets, each gradient reduced where it is made)."""
    points = [at for at, _, _ in made]
    for members in bucket_members([(nbytes, size) for _, nbytes, size in made], bucket_bytes):
        last = max(points[j] for j in members)
        for j in members:
            points[j] = last
    return points
