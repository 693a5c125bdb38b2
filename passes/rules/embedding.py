"""Embedding lookup and its dense backward.

``embedding(weight (V, D), indices (*I)) -> (*I, D)``: the index dims and the embedding
dim ``D`` shard freely (data parallel, or each device keeps a slice of every vector).
The vocabulary dim ``V`` shards too (Megatron's vocab-parallel embedding): a device holding
a block of rows looks up the indices it owns and writes zeros for the others, so the
result is a Partial sum over the devices splitting ``V`` -- ``V`` is a reduction factor,
as a contracted dim is. Indices are global row numbers: the runtime translates them with
the rank's row offset (``runtime/lowering/vocab.py``, applied by ``runtime/lowering/localize.py``). The
lookup is linear in the weight, so a Partial weight passes through.

``embedding_dense_backward(grad (*I, D), indices (*I), V) -> (V, D)`` scatters-adds each
gradient row into its vocabulary row: a sharded index dim leaves the result Partial (each
device adds its rows), unless ``scale_grad_by_freq`` divides by counts over all indices.
A sharded ``V`` keeps the rows each device owns (the runtime drops the others).
"""

from __future__ import annotations

from torchalpa.passes.rules.common import arg
from torchalpa.passes.rules.registry import FactorNamer, register


@register("aten.embedding.default")
def embedding(node, specs):
    (vocab, dim), indices = specs[0].shape, specs[1].shape
    f = FactorNamer()
    v, d = f.new(vocab), f.new(dim)
    index = f.dims(indices)
    return f.rule([((v,), (d,)), index], [index + ((d,),)], reductions=((v, "sum"),),
                  linear=(frozenset({0}),))


@register("aten.embedding_dense_backward.default")
def embedding_dense_backward(node, specs):
    indices = specs[1].shape
    vocab, dim = node.outputs[0].shape
    by_freq = bool(arg(node, 4, "scale_grad_by_freq", False))
    f = FactorNamer()
    index = f.dims(indices, blocked=by_freq)
    d = f.new(dim)
    v = f.new(vocab)
    reductions = () if by_freq else tuple((fac, "sum") for dims in index for fac in dims)
    return f.rule([index + ((d,),), index], [((v,), (d,))], reductions=reductions,
                  linear=(frozenset({0}),))
