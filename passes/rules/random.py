"""Random ops (dropout masks, ``rand``, ``bernoulli``): each device draws its own block.

A random op's result is a draw, not a function of its operands, so any layout of it is as
good as any other (in-place fills such as ``exponential_`` reach the graph as their
functional forms, ``aten.exponential``, once a training step is functionalized): the
rules below shard random results like elementwise results, and the runtime
(``runtime/lowering/random_draws.py``) makes a sharded draw well defined. Each op draws one number from
the default generator (the same on every rank: ``auto_parallel`` synchronizes the ranks'
generators) and every device seeds its block from that number and the block's
index on the mesh axes the result is sharded over:

- replicas of a block (devices along an axis the result is replicated over) draw the same
  numbers, so replicated values stay identical on every device;
- different blocks draw independent numbers, so a sharded dropout keeps its rate and its
  masks are independent across blocks (data-parallel dropout needs no all-gather, as in
  Alpa, which draws its masks per shard too).

A result replicated on every axis is drawn whole from the default generator, exactly as
on one device. The numbers of a sharded draw are not those one device draws with the same
seed (only their distribution is); ``AutoShardingOption(random="replicated")`` blocks every
factor of these ops, so every device draws whole tensors as one device would and training
equals the single-device run bitwise, at the cost of gathering dropout's input.

Every rule here sets ``random=True`` for that option. ``randperm`` stays whole: its values
are a permutation of the whole range, which no block can draw alone. ``native_dropout`` in
eval mode (``train=False``) draws nothing and is the identity; it is not random.
"""

from __future__ import annotations

from torchalpa.passes.rules.common import arg
from torchalpa.passes.rules.registry import FactorNamer, register


@register("aten.rand.default", "aten.randn.default", "aten.randint.default",
          "aten.randint.low")
def random_factory(node, specs):
    f = FactorNamer()
    return f.rule([], [f.dims(node.outputs[0].shape)], random=True)


@register("aten.randperm.default")
def randperm(node, specs):
    f = FactorNamer()
    return f.rule([], [f.dims(node.outputs[0].shape, blocked=True)], random=True)


@register("aten.rand_like.default", "aten.randn_like.default", "aten.randint_like.default",
          "aten.randint_like.low_dtype")
def random_like(node, specs):
    # The operand lends shape and memory layout: read in the result's layout, its block
    # has the block's shape (and whole, the order one device fills memory in).
    f = FactorNamer()
    out = f.dims(node.outputs[0].shape)
    return f.rule([out], [out], random=True)


@register("aten.bernoulli.default", "aten.bernoulli.p", "aten.bernoulli_.float",
          "aten.bernoulli_.Tensor", "aten.uniform_.default", "aten.normal_.default",
          "aten.exponential_.default", "aten.uniform.default", "aten.exponential.default",
          "aten.normal_functional.default")
def random_fill(node, specs):
    # Probabilities (bernoulli) apply elementwise; a filled tensor lends its shape. A
    # probability tensor that broadcasts is read whole.
    f = FactorNamer()
    out = f.dims(node.outputs[0].shape)
    operands = [out if spec.shape == node.outputs[0].shape else f.dims(spec.shape, blocked=True)
                for spec in specs]
    return f.rule(operands, [out], random=True)


@register("aten.native_dropout.default")
def native_dropout(node, specs):
    f = FactorNamer()
    dims = f.dims(specs[0].shape)
    return f.rule([dims], [dims, dims], random=arg(node, 2, "train", True) is not False)
