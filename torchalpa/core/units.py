"""Sizes and counts as people read them: ``1.5 GiB``, ``8.03 B``."""

from __future__ import annotations

__all__ = ["format_bytes", "format_count"]


def format_bytes(n: float) -> str:
    """``512 B``, ``1.5 KiB`` ... ``2.0 TiB`` (powers of 1024)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_count(n: float) -> str:
    """``8.03 B``, ``124 M``, ``3.1 K``: a count of parameters or elements."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f}"
