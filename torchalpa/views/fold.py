"""Folding repeated layers: ``layers.{0..31}.mlp.up_proj.weight ... x32``.

A dotted name's integer components (``layers.7``) are the indices of repeated modules.
``template`` replaces them with ``{}``; names with the same template *and* the same
attributes (shape, placement, ...) fold into one row, whose indices ``fold_indices``
prints as ranges: ``{0..31}``, ``{0..3,6}``. Layers that differ (a last layer planned
apart) keep their own rows, so folding never hides a difference.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

__all__ = ["template", "fold_indices", "fold", "op_label"]

_INDEX = re.compile(r"(?<![^.])\d+(?![^.])")     # a whole dotted component of digits
_SUFFIX = re.compile(r"_\d+$")


def template(name: str) -> tuple[str, tuple[int, ...]]:
    """``layers.3.mlp.w`` -> (``layers.{}.mlp.w``, (3,))."""
    indices = tuple(int(m) for m in _INDEX.findall(name))
    return _INDEX.sub("{}", name), indices


def op_label(node: str) -> str:
    """A graph node's op without fx's counter: ``permute_424`` -> ``permute``."""
    return _SUFFIX.sub("", node)


def fold_indices(values: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``0..3,6``."""
    values = sorted(set(values))
    parts, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(str(start) if start == v else f"{start}..{v}")
            start = None
    return ",".join(parts)


def _render(tmpl: str, members: Sequence[tuple[int, ...]]) -> str:
    if not members or not members[0]:
        return tmpl
    if len(members) == 1:
        return tmpl.format(*members[0])
    positions = list(zip(*members))
    shown = [str(vals[0]) if len(set(vals)) == 1 else "{" + fold_indices(vals) + "}"
             for vals in positions]
    return tmpl.format(*shown)


_Attrs = TypeVar("_Attrs", bound=Hashable)


def fold(items: Iterable[tuple[str, _Attrs]]) -> list[tuple[str, _Attrs, int]]:
    """``(name, attributes)`` pairs -> ``(folded name, attributes, count)`` rows, in the
    order each row first appears. Names fold only when their attributes are equal."""
    groups: dict[tuple[str, _Attrs], list[tuple[int, ...]]] = {}
    for name, attrs in items:
        tmpl, indices = template(name)
        groups.setdefault((tmpl, attrs), []).append(indices)
    return [(_render(tmpl, members), attrs, len(members))
            for (tmpl, attrs), members in groups.items()]
