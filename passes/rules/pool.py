"""Pooling over the trailing spatial dims (max with indices, average, adaptive average).

Every leading dim (batch, channels) shards freely. The spatial dims are blocked: windows
straddle block edges, adaptive windows depend on the whole size, and max-pool indices are
flat positions in the whole plane. The backward ops are linear in the incoming gradient.
"""

from __future__ import annotations

from torchalpa.passes.rules.registry import FactorNamer, register

# op -> number of trailing spatial dims
_POOLS = {
    "aten.max_pool2d_with_indices.default": 2,
    "aten.avg_pool2d.default": 2,
    "aten._adaptive_avg_pool2d.default": 2,
}
_POOL_BACKWARDS = {
    "aten.max_pool2d_with_indices_backward.default": 2,
    "aten.avg_pool2d_backward.default": 2,
    "aten._adaptive_avg_pool2d_backward.default": 2,
}


def _split(f: FactorNamer, shape, spatial: int):
    lead = f.dims(shape[:len(shape) - spatial])
    return lead, f.dims(shape[len(shape) - spatial:], blocked=True)


@register(*_POOLS)
def pool(node, specs):
    spatial = _POOLS[node.op]
    f = FactorNamer()
    lead, x_space = _split(f, specs[0].shape, spatial)
    y_space = f.dims(node.outputs[0].shape[len(lead):], blocked=True)
    y = lead + y_space
    results = [y] * len(node.outputs)  # max pool: (values, indices)
    linear = () if node.op.startswith("aten.max_pool") else (frozenset({0}),)
    return f.rule([lead + x_space], results, linear=linear)


@register(*_POOL_BACKWARDS)
def pool_backward(node, specs):
    # (grad_output, input, ..., [indices]) -> grad_input
    spatial = _POOL_BACKWARDS[node.op]
    f = FactorNamer()
    lead, x_space = _split(f, specs[1].shape, spatial)
    y = lead + f.dims(specs[0].shape[len(lead):], blocked=True)
    operands = [y, lead + x_space] + [y for _ in specs[2:]]  # max pool's indices
    return f.rule(operands, [lead + x_space], linear=(frozenset({0}),))
