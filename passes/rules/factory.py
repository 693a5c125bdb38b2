"""Ops that create tensors: any layout is free, each device makes its own block.

``*_like`` ops read their operand for shape and dtype only (``ignored``).
"""

from __future__ import annotations

from torchalpa.passes.rules import FactorNamer, register


@register("aten.full.default", "aten.zeros.default", "aten.ones.default",
          "aten.empty.memory_format", "aten.scalar_tensor.default")
def factory(node, specs):
    f = FactorNamer()
    return f.rule([], [f.dims(node.outputs[0].shape)])


@register("aten.full_like.default", "aten.zeros_like.default", "aten.ones_like.default",
          "aten.empty_like.default")
def factory_like(node, specs):
    f = FactorNamer()
    return f.rule([tuple(() for _ in specs[0].shape)], [f.dims(node.outputs[0].shape)],
                  ignored=frozenset({0}))
