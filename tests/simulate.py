"""Single-process stand-ins for a mesh of ranks: cut a tensor into the block each rank
holds under some placements, and put blocks back together, checking replicas agree."""

from __future__ import annotations

import functools
import itertools

import torch

from torchalpa.core.placement import Partial, Shard, is_shard, split_factor_of


def coords_of(mesh_shape):
    return list(itertools.product(*[range(n) for n in mesh_shape]))


def block(full: torch.Tensor, placements, mesh_shape, coord) -> torch.Tensor:
    """The block of ``full`` a rank at ``coord`` holds; Partial axes get random pieces that
    add up (or average) to the value, the same pieces whichever rank asks; a Partial max
    (min) axis gives the last rank the value and the others values at most (least) it."""
    x = full
    for axis, p in enumerate(placements):
        if isinstance(p, Partial) and p.reduce_op in ("max", "min"):
            n, k = mesh_shape[axis], coord[axis]
            gen = torch.Generator().manual_seed(1000 + axis)
            below = [_noise(x, gen).abs() for _ in range(n - 1)]
            x = x if k == n - 1 else x - below[k] if p.reduce_op == "max" else x + below[k]
        elif isinstance(p, Partial):
            n, k = mesh_shape[axis], coord[axis]
            gen = torch.Generator().manual_seed(1000 + axis)
            noise = [_noise(x, gen) for _ in range(n - 1)]
            piece = noise[k] if k < n - 1 else x - sum(noise)
            x = piece * n if p.reduce_op == "avg" else piece
    for axis, p in enumerate(placements):
        k = split_factor_of(p)
        if k > 1:   # a strided shard: this rank's block of each of k pieces
            n = mesh_shape[axis]
            x = x.unflatten(p.dim, (k, n, x.shape[p.dim] // (k * n))).select(
                p.dim + 1, coord[axis]).flatten(p.dim, p.dim + 1)
        elif isinstance(p, Shard):
            x = x.chunk(mesh_shape[axis], p.dim)[coord[axis]]
    return x.contiguous()


def _noise(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random piece of a Partial value, on the scale of the value so float rounding
    stays within tolerance. Huge or infinite values (masks) can't be split: their pieces
    are zeros and the last rank holds them whole. (Tensor ops only: under LocalTensorMode
    a Python scalar would have to agree across ranks.)"""
    if not x.is_floating_point():
        return torch.randint(-3, 4, x.shape, generator=gen).to(x.dtype)
    scale = x.abs().amax() if x.numel() else x.new_ones(())
    scale = torch.where(scale < 1e6, scale, torch.zeros_like(scale))
    return torch.randn(x.shape, generator=gen, dtype=x.dtype) * scale


def combine(blocks: dict, placements, mesh_shape) -> torch.Tensor:
    """Inverse of ``block``: the global value from every rank's block (inner axes first)."""
    current = dict(blocks)
    for axis in reversed(range(len(mesh_shape))):
        grouped: dict[tuple, list] = {}
        for coord, t in current.items():
            grouped.setdefault(coord[:axis], []).append((coord[axis], t))
        merged = {}
        for key, items in grouped.items():
            ts = [t for _, t in sorted(items, key=lambda kv: kv[0])]
            p = placements[axis]
            k = split_factor_of(p)
            if k > 1:   # each block holds a block of each piece: interleave them back
                pieces = [t.unflatten(p.dim, (k, t.shape[p.dim] // k)) for t in ts]
                merged[key] = torch.stack(pieces, p.dim + 1).flatten(p.dim, p.dim + 2)
            elif is_shard(p):
                merged[key] = torch.cat(ts, dim=p.dim)
            elif isinstance(p, Partial):
                if p.reduce_op in ("max", "min"):
                    pick = torch.maximum if p.reduce_op == "max" else torch.minimum
                    merged[key] = functools.reduce(pick, ts[1:], ts[0])
                    continue
                total = sum(ts[1:], ts[0].clone())
                merged[key] = total / len(ts) if p.reduce_op == "avg" else total
            else:
                for t in ts[1:]:
                    assert torch.equal(t, ts[0]) or (t.is_floating_point() and torch.allclose(
                        t, ts[0], rtol=0, atol=0, equal_nan=True)), f"replicas differ on axis {axis}"
                merged[key] = ts[0]
        current = merged
    return current[()]
