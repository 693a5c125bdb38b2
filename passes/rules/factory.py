"""Ops that create tensors: any layout is free, each device makes its own block.

``*_like`` and ``new_*`` ops read their operand for shape and dtype only (``ignored``);
``runtime/lowering/localize.py`` gives every factory the shape of its local block. A factory that
fills zeros may also produce a ``Partial`` sum (every device's zeros add up to zeros), so
an accumulator (``index_put``, ``scatter_add``) can start from it with each device adding
its own updates.

``arange`` is the exception: its values are global positions, so a device's block would
need its coordinate on the mesh, which localized ops do not carry. It is tiny, so it is
made whole on every device and consumers take their slice.
"""

from __future__ import annotations

from torchalpa.passes.rules.common import arg
from torchalpa.passes.rules.registry import FactorNamer, register

# op -> index of the fill value (None: always zeros; absent: values are not zeros).
_FILL_ARG = {
    "aten.full.default": 1, "aten.zeros.default": None, "aten.scalar_tensor.default": 0,
    "aten.full_like.default": 1, "aten.zeros_like.default": None,
    "aten.new_zeros.default": None, "aten.new_full.default": 2,
}


def _zero_filled(node) -> bool:
    if node.op not in _FILL_ARG:
        return False
    index = _FILL_ARG[node.op]
    return index is None or arg(node, index) in (0, 0.0, False)


def _linear(node):
    numeric = node.outputs[0].dtype != "bool"   # a Partial is a sum
    return (frozenset(),) if _zero_filled(node) and numeric else ()


@register("aten.full.default", "aten.zeros.default", "aten.ones.default",
          "aten.empty.memory_format", "aten.scalar_tensor.default",
          "aten.empty_permuted.default")
def factory(node, specs):
    f = FactorNamer()
    return f.rule([], [f.dims(node.outputs[0].shape, blocked=_permuted(node))],
                  linear=_linear(node))


def _permuted(node) -> bool:
    """``empty_permuted`` with a non-identity memory layout (a dropout mask's buffer):
    random fills draw in memory order, so it is made whole, exactly as on one device."""
    if node.op != "aten.empty_permuted.default":
        return False
    layout = arg(node, 1, "physical_layout")
    return list(layout) != list(range(len(layout)))


@register("aten.full_like.default", "aten.zeros_like.default", "aten.ones_like.default",
          "aten.empty_like.default", "aten.new_zeros.default", "aten.new_ones.default",
          "aten.new_empty.default", "aten.new_full.default", "aten.new_empty_strided.default")
def factory_like(node, specs):
    f = FactorNamer()
    return f.rule([tuple(() for _ in specs[0].shape)], [f.dims(node.outputs[0].shape)],
                  ignored=frozenset({0}), linear=_linear(node))


@register("aten.arange.default", "aten.arange.start", "aten.arange.start_step")
def arange(node, specs):
    f = FactorNamer()
    return f.rule([], [f.dims(node.outputs[0].shape, blocked=True)])


@register("torchalpa.constant.default")
def constant(node, specs):
    """A small constant the forward built from Python values (``frontends/constants.py``):
    like ``arange`` its values depend on position, so it is made whole on every device."""
    f = FactorNamer()
    return f.rule([], [f.dims(node.outputs[0].shape, blocked=True)])
