"""Factor-based sharding rules: one declarative rule per op kind.

A rule names the *factors* of an op's iteration space (like einsum letters) and says
which factors index each dim of each operand and result. Sharding a factor over a mesh
axis shards every dim it indexes; operands it does not index stay replicated on that
axis; a *reduction* factor (contracted, summed or averaged away) leaves the results
``Partial``. A dim made of several factors (a reshape merged them) can be sharded only
by its leading (major) factor. Strategies are derived from rules by shared code
(``passes/strategies.py``); the ILP only selects among them.

Two optional refinements cover ops that are not pure einsums:

- ``accumulators``: operands the op adds into (``index_put(accumulate=True)``'s and
  ``scatter_add``'s ``self``). On a mesh axis that shards a reduction factor such an operand
  does not index, it is read as ``Partial`` (each device adds its updates into its share)
  instead of ``Replicate`` (which would add the operand once per device).
- ``independent``: per result, the factors it does not depend on. On an axis sharding such a
  factor the result is computed whole on every device (``Replicate``) rather than being
  illegal. Results an op does not produce (``None`` outputs of backward ops with an
  ``output_mask``) list every factor.
- ``random``: the op draws random numbers (``rules/random.py``): each block of a sharded
  result is its own draw. ``AutoShardingOption(random="replicated")`` blocks every factor
  of such ops, for single-device numerics.

A rule describes an op whose results are positional: one entry per output the op's schema
returns, ``None`` outputs included, so ``results[i]`` matches ``getitem(op, i)``.

Rules are registered per op name with ``@register``; ``rule_for`` looks one up. An op
without a rule gets ``None``, and the planner gives it a replicate-only strategy and
lists it in the plan (never a wrong result).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable

from torchalpa.opgraph import OpGraph, OpNode, TensorSpec

__all__ = ["FactorRule", "register", "rule_for", "RULES", "has_rule"]

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

    @property
    def size_of(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def reduction_of(self) -> dict[str, str]:
        return dict(self.reductions)

    def factors(self) -> list[str]:
        return [f for f, _ in self.sizes]


RuleFn = Callable[[OpNode, list[TensorSpec]], FactorRule]
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


# Populate the registry: one module per op family.
from torchalpa.passes.rules import (  # noqa: E402,F401
    attention, conv, elementwise, embedding, factory, index, loss, markers, matmul, norm, pool,
    random, reduce, slicing, softmax, view)
