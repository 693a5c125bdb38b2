"""Matrix products: every dim is a factor; the contracted one leaves a Partial sum.

``torchalpa::batched_matmul`` (``torchalpa/ops/batched_matmul.py``) keeps each of its batch dims
whole, so batch and heads of hand-written attention shard independently.
"""

from __future__ import annotations

from torchalpa.passes.rules.registry import FactorNamer, register


@register("aten.mm.default")
def mm(node, specs):
    (m, k), (_, n) = specs[0].shape, specs[1].shape
    f = FactorNamer()
    fm, fk, fn = f.new(m), f.new(k), f.new(n)
    return f.rule([((fm,), (fk,)), ((fk,), (fn,))], [((fm,), (fn,))],
                  reductions=((fk, "sum"),), linear=(frozenset({0}), frozenset({1})), heavy=True)


@register("aten.bmm.default")
def bmm(node, specs):
    (b, m, k), (_, _, n) = specs[0].shape, specs[1].shape
    f = FactorNamer()
    fb, fm, fk, fn = f.new(b), f.new(m), f.new(k), f.new(n)
    return f.rule([((fb,), (fm,), (fk,)), ((fb,), (fk,), (fn,))], [((fb,), (fm,), (fn,))],
                  reductions=((fk, "sum"),), linear=(frozenset({0}), frozenset({1})), heavy=True)


@register("torchalpa.batched_matmul.default")
def batched_matmul(node, specs):
    a, b = specs[0].shape, specs[1].shape
    f = FactorNamer()
    batch = f.dims(a[:-2])
    fm, fk, fn = f.new(a[-2]), f.new(a[-1]), f.new(b[-1])
    return f.rule([batch + ((fm,), (fk,)), batch + ((fk,), (fn,))], [batch + ((fm,), (fn,))],
                  reductions=((fk, "sum"),), linear=(frozenset({0}), frozenset({1})), heavy=True)


@register("aten.linalg_solve_triangular.default")
def solve_triangular(node, specs):
    """``X = A^-1 B`` (``left``) or ``X = B A^-1``, A triangular (gated delta-rule
    attention: Qwen3-Next, Qwen3.5, OLMo-hybrid). Every column (``left``) or row of B is
    solved on its own, so that dim and the shared batch dims split; the triangular
    system (A's two dims, B's matching one) stays whole. Batch dims that broadcast fall
    back to replication (no rule)."""
    from torchalpa.passes.rules.common import arg
    a, b = specs[0].shape, specs[1].shape
    if len(a) != len(b) or tuple(a[:-2]) != tuple(b[:-2]):
        return None
    left = arg(node, None, "left", True) is not False
    f = FactorNamer()
    batch = f.dims(a[:-2])
    n = f.new(a[-1], blocked=True)
    free = f.new(b[-1] if left else b[-2])
    system = batch + ((f.new(a[-2], blocked=True),), (n,))
    rhs = batch + (((n,), (free,)) if left else ((free,), (n,)))
    return f.rule([system, rhs], [rhs], linear=(frozenset({1}),), heavy=True)
