"""Elementwise ops with broadcasting: one factor per result dim, shared by operands.

An operand dim of size 1 that broadcasts against a larger result dim has no factor (it
stays whole on every device). ``linear`` lists the operand groups a Partial value may
flow through unreduced: a sum of partials stays a partial sum under add/sub/neg, and
under mul/div when the other operand is replicated.
"""

from __future__ import annotations

from torchalpa.passes.rules import FactorNamer, register

# Ops that are linear in all their tensor operands jointly (Partial(sum) passes through).
_JOINTLY_LINEAR = {
    "aten.add.Tensor", "aten.sub.Tensor", "aten.neg.default", "aten.alias.default",
    "aten.detach.default", "aten.clone.default", "aten.mul.Scalar", "aten.div.Scalar",
    "aten._to_copy.default",
}
# Ops linear in each tensor operand separately (the others must be replicated).
_LINEAR_EACH = {"aten.mul.Tensor"}
# Linear in the first operand only.
_LINEAR_FIRST = {"aten.div.Tensor"}

POINTWISE = sorted(_JOINTLY_LINEAR | _LINEAR_EACH | _LINEAR_FIRST | {
    "aten.relu.default", "aten.gelu.default", "aten.silu.default", "aten.sigmoid.default",
    "aten.tanh.default", "aten.exp.default", "aten.log.default", "aten.sqrt.default",
    "aten.rsqrt.default", "aten.abs.default", "aten.sign.default", "aten.reciprocal.default",
    "aten.sin.default", "aten.cos.default", "aten.erf.default", "aten.log1p.default",
    "aten.expm1.default", "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor",
    "aten.maximum.default", "aten.minimum.default", "aten.where.self",
    "aten.le.Scalar", "aten.lt.Scalar", "aten.ge.Scalar", "aten.gt.Scalar", "aten.eq.Scalar",
    "aten.ne.Scalar", "aten.le.Tensor", "aten.lt.Tensor", "aten.ge.Tensor", "aten.gt.Tensor",
    "aten.eq.Tensor", "aten.ne.Tensor", "aten.logical_not.default", "aten.logical_and.default",
    "aten.logical_or.default", "aten.bitwise_not.default", "aten.clamp.default",
    "aten.clamp_min.default", "aten.clamp_max.default", "aten.threshold_backward.default",
    "aten.sigmoid_backward.default", "aten.tanh_backward.default", "aten.gelu_backward.default",
    "aten.silu_backward.default", "aten.rsub.Scalar", "aten.add.Scalar", "aten.sub.Scalar",
    "aten.fill.Scalar", "aten.masked_fill.Scalar", "aten.masked_fill.Tensor",
    "aten.leaky_relu.default", "aten.leaky_relu_backward.default", "aten.isnan.default",
    "aten.floor.default", "aten.ceil.default", "aten.round.default", "aten.trunc.default",
    "aten.fmod.Scalar", "aten.remainder.Scalar", "aten.bitwise_and.Tensor",
    "aten.bitwise_or.Tensor", "aten.logical_xor.default", "aten.square.default",
})


def _linear_groups(op: str, num_operands: int):
    if num_operands == 0:
        return ()
    if op in _JOINTLY_LINEAR:
        return (frozenset(range(num_operands)),)
    if op in _LINEAR_EACH:
        return tuple(frozenset({i}) for i in range(num_operands))
    if op in _LINEAR_FIRST:
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
    return f.rule(operands, [result], linear=_linear_groups(node.op, len(specs)))
