"""Placement types: how one tensor is laid out along one mesh axis.

DTensor's own vocabulary, re-exported: ``Shard(dim)``, ``Replicate()`` and ``Partial(op)``
*are* ``torch.distributed.tensor.Shard`` / ``Replicate`` / ``Partial`` (frozen, hashable
values), so a placement from a plan can be handed to ``distribute_tensor`` as it is, and
one written by hand with torch's classes is understood by torchalpa. The planner supports
``Partial`` with ``sum``, ``avg``, ``max`` or ``min`` (``check_placement``). A tensor's layout on an N-D
mesh is a tuple with one placement per mesh axis (``Placements``).

Text forms are torchalpa's own and stable across torch versions: ``format_placements``
writes what the plan JSON stores (``Shard(0)``, ``Replicate()``, ``Partial(sum)``), and
``short`` the compact form used in logs and summaries (``S(0)R``, ``P``).
``parse_placement`` reads both, and torch's ``Shard(dim=0)`` as well (old plans too).

One more DTensor placement is planned: ``strided(dim, k)``, torch's ``_StridedShard(dim,
split_factor=k)``: the dim read as ``k`` equal pieces, each piece split evenly over the
axis, so a device holds its block of every piece. That is how one fused projection is
split by heads when its output is cut into ``k`` pieces (nanoGPT's / GPT-2's ``c_attn``:
``q, k, v = x.split(H, dim=-1)``): every device gets its heads of q, of k and of v.
``_StridedShard`` is a ``Shard`` subclass (same dim, same block sizes), so code that only
needs block sizes treats both alike; code that needs which positions a device holds
asks ``split_factor_of``. Text forms: ``StridedShard(0, 3)`` / ``S(0)/3``. On a 2D mesh
both axes may hold one of a dim with the same k (``stacked_strided``): the pieces split
on axis 0, each block again on axis 1, as DTensor reads the placements left to right.
"""

from __future__ import annotations

import re
from functools import cache
from typing import TYPE_CHECKING, TypeGuard, Union

if TYPE_CHECKING:
    from torch.distributed.tensor import Partial, Replicate, Shard

__all__ = [
    "Shard", "Replicate", "Partial", "Placement", "Placements",
    "parse_placement", "format_placements", "parse_placements", "replicated", "short",
    "local_shape", "check_placement", "long_form", "short_form", "strided",
    "split_factor_of", "is_shard", "is_partial", "is_replicate", "kind_of",
    "stacked_strided",
]

_REDUCE_OPS = ("sum", "avg", "max", "min")


@cache
def _classes():
    """torch's placement classes, imported on first use: importing torchalpa (its CLI's
    ``--help``, a plan read for display) must not pay for importing torch."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    return Shard, Replicate, Partial


def __getattr__(name: str):
    if name in ("Shard", "Replicate", "Partial"):
        return _classes()[("Shard", "Replicate", "Partial").index(name)]
    raise AttributeError(f"module 'torchalpa.core.placement' has no attribute {name!r}")


def check_placement(p) -> Placement:
    """``p`` if the planner supports it, else a ``ValueError`` naming what it accepts."""
    Shard, Replicate, Partial = _classes()
    if isinstance(p, Partial):
        if p.reduce_op not in _REDUCE_OPS:
            raise ValueError(f"Partial reduce_op must be one of {_REDUCE_OPS}, got "
                             f"{p.reduce_op!r}")
    elif not is_shard(p) and not isinstance(p, Replicate):
        raise TypeError(f"a placement must be torch.distributed.tensor Shard(dim), Replicate() "
                        f"or Partial(op), got {p!r} ({type(p).__name__})")
    return p


def strided(dim: int, split_factor: int):
    """A dim read as ``split_factor`` pieces, each split over the axis (``_StridedShard``)."""
    from torch.distributed.tensor.placement_types import _StridedShard
    return _StridedShard(dim, split_factor=split_factor)


@cache
def _strided_class():
    from torch.distributed.tensor.placement_types import _StridedShard
    return _StridedShard


KIND_OF_TYPE: dict[type, str] = {}
"""Placement type -> "shard", "replicate", "partial" or "" (another type). torch's
placement classes check instances through a Python ``__instancecheck__`` (their
metaclass), which made ``isinstance`` on layouts most of the planner's pure-Python time;
a type is looked up once."""


def kind_of(p) -> str:
    """``"shard"`` (``Shard`` or ``_StridedShard``), ``"replicate"``, ``"partial"``, or
    ``""`` for anything else; what ``isinstance`` says, looked up once per type."""
    t = type(p)
    kind = KIND_OF_TYPE.get(t)
    if kind is None:
        Shard, Replicate, Partial = _classes()
        kind = "shard" if isinstance(p, (Shard, _strided_class())) else \
            "replicate" if isinstance(p, Replicate) else \
            "partial" if isinstance(p, Partial) else ""
        KIND_OF_TYPE[t] = kind
    return kind


def is_shard(p) -> TypeGuard[Shard]:
    """Whether ``p`` splits a dim into blocks: ``Shard`` or ``_StridedShard`` (which torch
    does not derive from ``Shard``; block sizes are the same)."""
    return kind_of(p) == "shard"


def is_partial(p) -> TypeGuard[Partial]:
    """``isinstance(p, Partial)``, looked up once per type (``kind_of``)."""
    return kind_of(p) == "partial"


def is_replicate(p) -> TypeGuard[Replicate]:
    """``isinstance(p, Replicate)``, looked up once per type (``kind_of``)."""
    return kind_of(p) == "replicate"


def split_factor_of(p) -> int:
    """How many pieces a shard's dim is read as: 1 for a plain ``Shard`` (or none)."""
    return int(getattr(p, "split_factor", 1))


def stacked_strided(placements, axis: int, mesh_shape) -> bool:
    """Whether ``placements[axis]`` is a strided shard whose dim every other axis that
    splits it (of more than one device; at least one) splits as a strided shard with the
    same ``split_factor`` k: DTensor's ``(_StridedShard(d, k), _StridedShard(d, k))``
    read left to right, the k pieces outermost, each split by the axes in order (a fused
    (3, H) q/k/v split by heads over both axes of a 2D mesh)."""
    p = placements[axis]
    k = split_factor_of(p)
    if k == 1 or not is_shard(p) or mesh_shape[axis] == 1:
        return False
    others = [q for b, q in enumerate(placements)
              if b != axis and mesh_shape[b] > 1 and is_shard(q) and q.dim == p.dim]
    return bool(others) and all(split_factor_of(q) == k for q in others)


def long_form(p) -> str:
    """``Shard(0)`` / ``StridedShard(0, 3)`` / ``Replicate()`` / ``Partial(sum)``: the plan
    JSON's form."""
    Shard, Replicate, Partial = _classes()
    if split_factor_of(p) > 1:
        return f"StridedShard({p.dim}, {split_factor_of(p)})"
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    return "Replicate()"


def short_form(p) -> str:
    """``S(0)`` / ``S(0)/3`` / ``R`` / ``P`` (``P(avg)`` for a mean)."""
    Shard, Replicate, Partial = _classes()
    if split_factor_of(p) > 1:
        return f"S({p.dim})/{split_factor_of(p)}"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return "R"


Placement = Union["Shard", "Replicate", "Partial"]
Placements = tuple  # tuple[Placement, ...], one per mesh axis

_PATTERNS = [
    (re.compile(r"^(?:StridedShard\((-?\d+), *(\d+)\)|S\((-?\d+)\)/(\d+))$"),
     lambda m: strided(int(m.group(1) or m.group(3)), int(m.group(2) or m.group(4)))),
    (re.compile(r"^(?:Shard\((?:dim=)?(-?\d+)\)|S\((-?\d+)\))$"),
     lambda m: _classes()[0](int(m.group(1) or m.group(2)))),
    (re.compile(r"^(?:Replicate\(\)|R)$"), lambda m: _classes()[1]()),
    (re.compile(r"^(?:Partial\((?:reduce_op=)?'?(\w+)'?\)|P\((\w+)\))$"),
     lambda m: check_placement(_classes()[2](m.group(1) or m.group(2)))),
    (re.compile(r"^(?:Partial\(\)|P)$"), lambda m: _classes()[2]()),
]


def parse_placement(text: str) -> Placement:
    """Parse ``Shard(0)`` / ``S(0)`` / ``StridedShard(0, 3)`` / ``S(0)/3`` / ``Replicate()``
    / ``R`` / ``Partial(sum)`` / ``P``."""
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
    return [long_form(p) for p in placements]


def short(placements: Placements) -> str:
    """Compact form for logs: ``S(0)R`` for (Shard(0), Replicate())."""
    return "".join(short_form(p) for p in placements)


def replicated(num_axes: int) -> Placements:
    Shard, Replicate, Partial = _classes()
    return tuple(Replicate() for _ in range(num_axes))


def local_shape(shape: tuple[int, ...], placements: Placements, mesh_shape) -> tuple[int, ...]:
    """The block of a tensor of global ``shape`` that one device holds."""
    Shard, Replicate, Partial = _classes()
    out = list(shape)
    for axis, p in enumerate(placements):
        if is_shard(p):
            out[p.dim] //= mesh_shape[axis]
    return tuple(out)
