"""Matrix products: every dim is a factor; the contracted one leaves a Partial sum.

``torchalpa::batched_matmul`` (``torchalpa/batched_matmul.py``) keeps each of its batch dims
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
