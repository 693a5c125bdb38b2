"""Sizes and counts as people read them: ``1.5 GiB``, ``8.03 B``."""

from __future__ import annotations

import numbers
import re

__all__ = ["check_bytes", "format_bytes", "format_count"]

_UNITS = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30, "TIB": 2 ** 40}


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


def check_bytes(value, name: str, *, positive: bool = True) -> None:
    """Raise unless ``value`` is a number of bytes (> 0, or >= 0 without ``positive``); the
    error names ``name`` and, for a size written as text ("16GB", "16GiB"), the number to
    write instead: the two units differ by 7 %, so the field takes no text to guess from."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = "a number of bytes, e.g. 16 * 2**30 for 16 GiB or 16e9 for 16 GB"
        found = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B)\s*", str(value), re.IGNORECASE)
        if isinstance(value, str) and found and found.group(2).upper() in _UNITS:
            number, unit = found.group(1), found.group(2)
            power = {"K": 10, "M": 20, "G": 30, "T": 40}[unit[0].upper()]
            hint = (f"a number of bytes: {number} * 2**{power} for {number} "
                    f"{unit[0].upper()}iB, {number}e{power * 3 // 10} for {number} "
                    f"{unit[0].upper()}B")
        raise TypeError(f"{name} must be {hint}; got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'} bytes, got {value!r}")
