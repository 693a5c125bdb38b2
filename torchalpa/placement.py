"""Placement types: how one tensor is laid out along one mesh axis.

DTensor's vocabulary, as small frozen values that the planner can use without importing
torch: ``Shard(dim)``, ``Replicate()``, ``Partial(op)``. A tensor's layout on an N-D mesh
is a tuple with one placement per mesh axis (``Placements``). ``repr`` prints the form
DTensor prints and the plan JSON stores (``Shard(0)``); ``str`` the short form used in
logs and summaries (``S(0)``, ``R``, ``P``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

__all__ = [
    "Shard", "Replicate", "Partial", "Placement", "Placements",
    "parse_placement", "format_placements", "parse_placements", "replicated", "short",
    "local_shape",
]

_REDUCE_OPS = ("sum", "avg")


@dataclass(frozen=True, slots=True)
class Shard:
    """The tensor is split evenly along ``dim`` across the devices of the axis."""

    dim: int

    def __repr__(self) -> str:
        return f"Shard({self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every device of the axis holds the whole tensor."""

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    """Every device holds a partial value; the true value is their ``reduce_op``."""

    reduce_op: str = "sum"

    def __post_init__(self):
        if self.reduce_op not in _REDUCE_OPS:
            raise ValueError(f"Partial reduce_op must be one of {_REDUCE_OPS}, got {self.reduce_op!r}")

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"

    def __str__(self) -> str:
        return "P" if self.reduce_op == "sum" else f"P({self.reduce_op})"


Placement = Union[Shard, Replicate, Partial]
Placements = tuple  # tuple[Placement, ...], one per mesh axis

_PATTERNS = [
    (re.compile(r"^(?:Shard\((?:dim=)?(-?\d+)\)|S\((-?\d+)\))$"), lambda m: Shard(int(m.group(1) or m.group(2)))),
    (re.compile(r"^(?:Replicate\(\)|R)$"), lambda m: Replicate()),
    (re.compile(r"^(?:Partial\((?:reduce_op=)?'?(\w+)'?\)|P\((\w+)\))$"), lambda m: Partial(m.group(1) or m.group(2))),
    (re.compile(r"^(?:Partial\(\)|P)$"), lambda m: Partial()),
]


def parse_placement(text: str) -> Placement:
    """Parse ``Shard(0)`` / ``S(0)`` / ``Replicate()`` / ``R`` / ``Partial(sum)`` / ``P``."""
    text = text.strip()
    for pattern, build in _PATTERNS:
        m = pattern.match(text)
        if m:
            return build(m)
    raise ValueError(f"cannot parse placement {text!r}; expected e.g. 'Shard(0)', 'Replicate()', 'Partial(sum)'")


def parse_placements(texts) -> Placements:
    return tuple(parse_placement(t) for t in texts)


def format_placements(placements: Placements) -> list[str]:
    """The JSON form: one DTensor-style string per mesh axis."""
    return [repr(p) for p in placements]


def short(placements: Placements) -> str:
    """Compact form for logs: ``S(0)R`` for (Shard(0), Replicate())."""
    return "".join(str(p) for p in placements)


def replicated(num_axes: int) -> Placements:
    return tuple(Replicate() for _ in range(num_axes))


def local_shape(shape: tuple[int, ...], placements: Placements, mesh_shape) -> tuple[int, ...]:
    """The block of a tensor of global ``shape`` that one device holds."""
    out = list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            out[p.dim] //= mesh_shape[axis]
    return tuple(out)
