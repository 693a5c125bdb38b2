"""Random ops (dropout masks, ``rand``, ``bernoulli``): whole on every device.

A sharded run must draw exactly the numbers the single-device run draws with the same
seed. Every rank starts from the same generator state, so if every rank draws the *whole*
tensor, in the same order as the single-device program, every rank holds the same values
that program would; consumers that want a block take their slice locally (no
communication). Drawing only a block per device would consume the generator differently
and change the numbers. So every factor of these ops is blocked: their only strategy is
replicated, and their tensor operands (probabilities, or the tensor ``bernoulli_`` fills)
are read whole too -- even the operand of ``rand_like``, which lends only its shape and
memory layout, since the numbers land in memory order.

``native_dropout`` in eval mode (``train=False``) draws nothing and is the identity, so it
shards like an elementwise op.
"""

from __future__ import annotations

from torchalpa.passes.rules.registry import FactorNamer, register
from torchalpa.passes.rules.common import arg


def _whole(f: FactorNamer, shape):
    return f.dims(shape, blocked=True)


@register("aten.rand.default", "aten.randn.default", "aten.randint.default",
          "aten.randint.low", "aten.randperm.default")
def random_factory(node, specs):
    f = FactorNamer()
    return f.rule([], [_whole(f, node.outputs[0].shape)])


@register("aten.rand_like.default", "aten.randn_like.default", "aten.randint_like.default",
          "aten.randint_like.low_dtype")
def random_like(node, specs):
    f = FactorNamer()
    out = _whole(f, node.outputs[0].shape)
    return f.rule([out], [out])


@register("aten.bernoulli.default", "aten.bernoulli.p", "aten.bernoulli_.float",
          "aten.bernoulli_.Tensor", "aten.uniform_.default", "aten.normal_.default",
          "aten.exponential_.default")
def random_fill(node, specs):
    f = FactorNamer()
    out = _whole(f, node.outputs[0].shape)
    operands = [out if spec.shape == node.outputs[0].shape else _whole(f, spec.shape)
                for spec in specs]
    return f.rule(operands, [out])


@register("aten.native_dropout.default")
def native_dropout(node, specs):
    f = FactorNamer()
    train = arg(node, 2, "train", True)
    dims = f.dims(specs[0].shape, blocked=train is not False)
    return f.rule([dims], [dims, dims])
