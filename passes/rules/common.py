"""Helpers shared by rule modules: reading an op's arguments and placing operand dims.

Rules see an ``OpNode`` whose ``args``/``kwargs`` hold plain values with tensor arguments
replaced by ``Operand(k)`` markers. ``arg`` reads a non-tensor argument by position or
keyword; ``by_position`` turns a rule's per-argument dims (keyed by argument position,
``(position, item)`` for tensors inside a list, or keyword name) into the per-operand
list a ``FactorRule`` wants, in operand order.
"""

from __future__ import annotations

from typing import Any

from torchalpa.core.opgraph import Operand, OpNode

__all__ = ["arg", "positions", "by_position", "dim_list", "keepdim_of"]

_MISSING = object()


def arg(node: OpNode, index: int | None, name: str | None = None, default: Any = None) -> Any:
    """Argument ``index`` of the call (or keyword ``name``), else ``default``."""
    if index is not None and index < len(node.args):
        return node.args[index]
    if name is not None:
        value = node.kwarg_dict.get(name, _MISSING)
        if value is not _MISSING:
            return value
    return default


def positions(node: OpNode) -> list:
    """For each tensor operand, in order, where it sits: ``i``, ``(i, j)`` or a keyword."""
    found: dict[int, Any] = {}

    def visit(value, key):
        if isinstance(value, Operand):
            found[value.k] = key
        elif isinstance(value, tuple):
            for j, item in enumerate(value):
                visit(item, (key, j))

    for i, a in enumerate(node.args):
        visit(a, i)
    for name, a in node.kwargs:
        visit(a, name)
    return [found[k] for k in range(len(found))]


def by_position(node: OpNode, dims_at) -> list:
    """Operand dims in operand order; ``dims_at(key)`` gives the dims of the tensor at key."""
    return [dims_at(key) for key in positions(node)]


def dim_list(value, rank: int) -> list[int] | None:
    """Normalized dims from an int / list argument; None (or []) means every dim."""
    if value is None:
        return None
    if isinstance(value, int):
        value = (value,)
    if len(value) == 0:
        return None
    return sorted({d + rank if d < 0 else d for d in value}) if rank else []


def keepdim_of(node: OpNode, index: int) -> bool:
    return bool(arg(node, index, "keepdim", False))
