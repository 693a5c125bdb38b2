"""Elementwise ops with broadcasting: one factor per result dim, shared by operands.

An operand dim of size 1 that broadcasts against a larger result dim has no factor (it
stays whole on every device). ``linear`` lists the operand groups a Partial value may
flow through unreduced: a sum of partials stays a partial sum under add/sub/neg, under
mul/div when the other operand is replicated, under ``where`` in its two value operands,
and under the backward of an activation in its incoming gradient. Casts pass a Partial
only to floating dtypes (rounding each piece to an integer would change the sum).

In-place variants (``add_``, ``div_``...) appear in traced graphs as ordinary calls whose
result the graph uses afterwards; they follow the same rule as their functional form.
"""

from __future__ import annotations

from torchalpa.passes.rules.common import arg
from torchalpa.passes.rules.registry import FactorNamer, register

# Linear in all their tensor operands jointly (Partial(sum) passes through).
_JOINTLY_LINEAR = {
    "aten.add.Tensor", "aten.sub.Tensor", "aten.neg.default", "aten.alias.default",
    "aten.detach.default", "aten.clone.default", "aten.mul.Scalar", "aten.div.Scalar",
    "aten._to_copy.default", "aten.add_.Tensor", "aten.mul_.Scalar", "aten.div_.Scalar",
    "aten.lift_fresh_copy.default", "aten.copy_.default", "aten.copy.default",
    "aten._conj.default",
}
# Binary ops that are only affine when one side is a Python scalar.
_AFFINE_WITH_SCALAR = {"aten.add.Tensor", "aten.sub.Tensor", "aten.add_.Tensor"}
# Linear in each tensor operand separately (the others must be replicated).
_LINEAR_EACH = {"aten.mul.Tensor", "aten.mul_.Tensor"}
# Linear in the first operand only: division, and activation backwards in the gradient.
_LINEAR_FIRST = {
    "aten.div.Tensor", "aten.div_.Tensor", "aten.threshold_backward.default",
    "aten.sigmoid_backward.default", "aten.tanh_backward.default", "aten.gelu_backward.default",
    "aten.silu_backward.default", "aten.leaky_relu_backward.default",
    "aten.elu_backward.default", "aten.hardtanh_backward.default",
    "aten.native_dropout_backward.default",
}
# Linear in the operands after a condition / mask that must be replicated.
_LINEAR_AFTER_FIRST = {"aten.where.self"}
# Linear in the first operand when the value they write is zero.
_LINEAR_IF_ZERO_FILL = {"aten.masked_fill.Scalar": 2, "aten.masked_fill_.Scalar": 2}

_FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16", "complex64", "complex128"}

POINTWISE = sorted(_JOINTLY_LINEAR | _LINEAR_EACH | _LINEAR_FIRST | _LINEAR_AFTER_FIRST
                   | set(_LINEAR_IF_ZERO_FILL) | {
    "aten.relu.default", "aten.gelu.default", "aten.silu.default", "aten.sigmoid.default",
    "aten.tanh.default", "aten.exp.default", "aten.log.default", "aten.sqrt.default",
    "aten.rsqrt.default", "aten.abs.default", "aten.sign.default", "aten.reciprocal.default",
    "aten.sin.default", "aten.cos.default", "aten.erf.default", "aten.log1p.default",
    "aten.expm1.default", "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor",
    "aten.pow.Scalar", "aten.exp2.default", "aten.log2.default",
    "aten.maximum.default", "aten.minimum.default",
    "aten.le.Scalar", "aten.lt.Scalar", "aten.ge.Scalar", "aten.gt.Scalar", "aten.eq.Scalar",
    "aten.ne.Scalar", "aten.le.Tensor", "aten.lt.Tensor", "aten.ge.Tensor", "aten.gt.Tensor",
    "aten.eq.Tensor", "aten.ne.Tensor", "aten.logical_not.default", "aten.logical_and.default",
    "aten.logical_or.default", "aten.bitwise_not.default", "aten.clamp.default",
    "aten.clamp.Tensor", "aten.clamp_min.default", "aten.clamp_max.default",
    "aten.rsub.Scalar", "aten.add.Scalar", "aten.sub.Scalar", "aten.add_.Scalar",
    "aten.fill.Scalar", "aten.masked_fill.Tensor",
    "aten.leaky_relu.default", "aten.isnan.default", "aten.isinf.default",
    "aten.floor.default", "aten.ceil.default", "aten.round.default", "aten.trunc.default",
    "aten.fmod.Scalar", "aten.remainder.Scalar", "aten.remainder.Tensor",
    "aten.div.Tensor_mode", "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor",
    "aten.logical_xor.default", "aten.square.default", "aten.hardtanh.default",
    "aten.elu.default",
    # inverse and hyperbolic trigonometry (YOSO's LSH collision probability uses acos)
    "aten.acos.default", "aten.asin.default", "aten.atan.default", "aten.tan.default",
    "aten.sinh.default", "aten.cosh.default", "aten.log10.default", "aten.erfinv.default",
    # complex numbers (rotary embeddings written with them: rules/complex_ops.py)
    "aten.polar.default", "aten.complex.default",
})


def _linear_groups(node, num_operands: int):
    op = node.op
    if num_operands == 0:
        return ()
    if op in ("aten._to_copy.default", "aten.copy_.default", "aten.copy.default") \
            and node.outputs[0].dtype not in _FLOAT_DTYPES:
        return ()
    if op in _AFFINE_WITH_SCALAR and num_operands < 2:
        return ()   # x + 1 adds the constant once per device
    if op in _JOINTLY_LINEAR:
        return (frozenset(range(num_operands)),)
    if op in _LINEAR_EACH:
        return tuple(frozenset({i}) for i in range(num_operands))
    if op in _LINEAR_FIRST:
        return (frozenset({0}),)
    if op in _LINEAR_AFTER_FIRST:
        return (frozenset(range(1, num_operands)),)
    if op in _LINEAR_IF_ZERO_FILL and arg(node, _LINEAR_IF_ZERO_FILL[op]) == 0:
        return (frozenset({0}),)
    return ()


@register(*POINTWISE)
def pointwise(node, specs):
    out = node.outputs[0].shape
    f = FactorNamer()
    result = f.dims(out)
    operands = []
    for spec in specs:
        offset = len(out) - len(spec.shape)
        dims = []
        for j, size in enumerate(spec.shape):
            k = j + offset
            dims.append(result[k] if size == out[k] else ())
        operands.append(tuple(dims))
    return f.rule(operands, [result], linear=_linear_groups(node, len(specs)))
