"""Validation helpers for the zoo's config dataclasses: errors name field, value, rule."""

from __future__ import annotations

__all__ = ["check_positive", "check_divisible", "check_probability"]


def check_positive(config, *fields: str) -> None:
    for name in fields:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive int, "
                             f"got {value!r}")


def check_divisible(config, field: str, by: str) -> None:
    value, divisor = getattr(config, field), getattr(config, by)
    if value % divisor:
        raise ValueError(f"{type(config).__name__}.{field}={value} must be divisible by "
                         f"{by}={divisor}")


def check_probability(config, *fields: str) -> None:
    for name in fields:
        value = getattr(config, name)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{type(config).__name__}.{name} must be in [0, 1), got {value!r}")
