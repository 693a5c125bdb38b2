"""The sharding-rule registry: ``FactorRule``, ``@register``, ``rule_for``, ``FactorNamer``.

Kept apart from the rule families so that a family module imports only this module (never
the package ``torchalpa.passes.rules``, whose ``__init__`` imports every family): no import
cycles. ``torchalpa.passes.rules`` re-exports every name defined here. See the package
docstring for what a rule describes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

from torchalpa.core.opgraph import OpGraph, OpNode, TensorSpec

__all__ = ["FactorRule", "FactorNamer", "register", "rule_for", "RULES", "has_rule",
           "normalize_dim"]

Dims = tuple  # tuple[tuple[str, ...], ...]: per tensor dim, its factors, major first


@dataclass(frozen=True, slots=True)
class FactorRule:
    """How the dims of an op's operands and results map onto shared factors."""

    operands: tuple[Dims, ...]
    results: tuple[Dims, ...]
    sizes: tuple[tuple[str, int], ...]
    reductions: tuple[tuple[str, str], ...] = ()   # factor -> "sum" | "avg"
    blocked: frozenset = frozenset()               # factors that must never be sharded
    linear: tuple[frozenset, ...] = ()             # operand groups a Partial may pass through
    ignored: frozenset = frozenset()               # operands read for shape/dtype only
    heavy: bool = False                            # compute-bound (matmul, conv): never redundant
    accumulators: frozenset = frozenset()          # operands added into: Partial, not Replicate
    independent: tuple[frozenset, ...] = ()        # per result: factors it does not depend on
    random: bool = False                           # results are random draws, per block
    synced: tuple[tuple[str, tuple[str, ...]], ...] = ()   # factor -> its statistics' reductions
    batch_synced: frozenset = frozenset()          # factors split at the price of a batch sync
    batch_sync_stats: tuple = (0, ())              # (bytes per entry, factors indexing them)
    strided: frozenset = frozenset()               # factors splittable as the minor factor of
                                                   # a merged dim: a strided shard of it

    @property
    def size_of(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def reduction_of(self) -> dict[str, str]:
        return dict(self.reductions)

    def factors(self) -> list[str]:
        return [f for f, _ in self.sizes]


RuleFn = Callable[[OpNode, list[TensorSpec]], FactorRule | None]   # None: declines this call
RULES: dict[str, RuleFn] = {}


def register(*ops: str) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn(node, operand_specs) -> FactorRule`` for each op name.

    A Partial value is a sum, which a bool tensor cannot be: every rule's ``linear``
    groups that hold a bool operand are dropped here, once for all rules.
    """
    def wrap(fn: RuleFn) -> RuleFn:
        @functools.wraps(fn)
        def rule(node: OpNode, specs: list[TensorSpec]) -> FactorRule | None:
            built = fn(node, specs)
            if built is None or not built.linear:
                return built
            numeric = tuple(g for g in built.linear if all(specs[i].dtype != "bool" for i in g))
            return built if numeric == built.linear else replace(built, linear=numeric)

        for op in ops:
            if op in RULES:
                raise ValueError(f"duplicate sharding rule for {op}")
            RULES[op] = rule
        return fn
    return wrap


def has_rule(op: str) -> bool:
    return op in RULES


def rule_for(node: OpNode, graph: OpGraph) -> FactorRule | None:
    """The node's rule, or None if its op has none, or its rule declines this call
    (replicate-only fallback)."""
    fn = RULES.get(node.op)
    if fn is None:
        return None
    return fn(node, [graph.spec(r) for r in node.operands])


class FactorNamer:
    """Hands out factor names and records their sizes while a rule is built."""

    def __init__(self):
        self.sizes: dict[str, int] = {}
        self.blocked: set[str] = set()

    def new(self, size: int, blocked: bool = False) -> str:
        name = f"f{len(self.sizes)}"
        self.sizes[name] = int(size)
        if blocked:
            self.blocked.add(name)
        return name

    def dims(self, shape, blocked: bool = False) -> Dims:
        """One fresh factor per dim (none for size-1 dims, which can't be split)."""
        return tuple((self.new(s, blocked),) if s != 1 else () for s in shape)

    def all(self) -> frozenset:
        """Every factor named so far (for ``independent`` entries of absent results)."""
        return frozenset(self.sizes)

    def rule(self, operands, results, **kw) -> FactorRule:
        blocked = frozenset(kw.pop("blocked", ())) | frozenset(self.blocked)
        return FactorRule(operands=tuple(operands), results=tuple(results),
                          sizes=tuple(self.sizes.items()), blocked=blocked, **kw)


def normalize_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim
