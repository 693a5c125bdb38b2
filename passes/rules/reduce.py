"""Reductions and scans over some dims of one tensor.

Sums and means are linear: a sharded reduced dim leaves a ``Partial`` (sum / avg) result,
and a Partial operand passes through. The value-only max and min (``amax``, ``amin``, the
global ``max``/``min``) are each the max (min) of the devices' own: a sharded reduced dim
leaves a ``Partial`` max (min), made whole by one all-reduce with that op -- a softmax
written as its steps (JAX's, or a hand-written one) splits its dim as ``_softmax`` does.
Every other reduction (max/min with indices, arg-max, any/all, var, std, prod, logsumexp,
norms) is not combined that simply, so its reduced dims are blocked; its kept dims shard
freely. Scans (cumsum, cumprod) keep their shape but
each element depends on the whole prefix, so the scanned dim is blocked.
"""

from __future__ import annotations

from torchalpa.passes.rules.common import arg, dim_list, keepdim_of
from torchalpa.passes.rules.registry import FactorNamer, register

# op -> (index of its dim argument, index of keepdim, Partial kind or None, num results)
_REDUCTIONS = {
    "aten.sum.dim_IntList": (1, 2, "sum", 1), "aten.sum.default": (None, None, "sum", 1),
    "aten.mean.dim": (1, 2, "avg", 1), "aten.mean.default": (None, None, "avg", 1),
    "aten.amax.default": (1, 2, "max", 1), "aten.amin.default": (1, 2, "min", 1),
    "aten.max.dim": (1, 2, None, 2), "aten.min.dim": (1, 2, None, 2),
    "aten.max.default": (None, None, "max", 1), "aten.min.default": (None, None, "min", 1),
    "aten.argmax.default": (1, 2, None, 1), "aten.argmin.default": (1, 2, None, 1),
    "aten.any.dim": (1, 2, None, 1), "aten.any.dims": (1, 2, None, 1),
    "aten.any.default": (None, None, None, 1), "aten.all.dim": (1, 2, None, 1),
    "aten.all.default": (None, None, None, 1),
    "aten.var.correction": (1, None, None, 1), "aten.std.correction": (1, None, None, 1),
    "aten.var_mean.correction": (1, None, None, 2),
    "aten.prod.dim_int": (1, 2, None, 1), "aten.prod.default": (None, None, None, 1),
    "aten.logsumexp.default": (1, 2, None, 1),
    "aten.linalg_vector_norm.default": (2, 3, None, 1),
}


@register(*_REDUCTIONS)
def reduction(node, specs):
    shape = specs[0].shape
    rank = len(shape)
    dim_index, keep_index, kind, num_results = _REDUCTIONS[node.op]
    dims = dim_list(arg(node, dim_index, "dim"), rank) if dim_index is not None else None
    reduced = set(range(rank)) if dims is None else set(dims)
    keepdim = keepdim_of(node, keep_index) if keep_index is not None \
        else bool(node.kwarg_dict.get("keepdim", False))
    f = FactorNamer()
    operand = tuple((f.new(s, blocked=kind is None and d in reduced),) if s != 1 else ()
                    for d, s in enumerate(shape))
    result = []
    for d in range(rank):
        if d in reduced:
            if keepdim:
                result.append(())
        else:
            result.append(operand[d])
    reductions = tuple((fac, kind) for d in sorted(reduced) for fac in operand[d]) if kind else ()
    # A Partial sum passes through sum and mean unchanged: both are linear.
    linear = (frozenset({0}),) if kind in ("sum", "avg") else ()
    return f.rule([operand], [tuple(result)] * num_results, reductions=reductions, linear=linear)


@register("aten.cumsum.default", "aten.cumprod.default")
def scan(node, specs):
    shape = specs[0].shape
    (dim,) = dim_list(arg(node, 1, "dim"), len(shape)) or [0]
    f = FactorNamer()
    dims = tuple((f.new(s, blocked=d == dim),) if s != 1 else () for d, s in enumerate(shape))
    linear = (frozenset({0}),) if node.op == "aten.cumsum.default" else ()
    return f.rule([dims], [dims], linear=linear)


@register("aten.histc.default")
def histc(node, specs):
    """Counts per bin (MoE routers count tokens per expert): with a fixed range
    (``min < max``) every device counts its own elements and the counts add up, so a
    sharded operand gives a Partial sum; with ``min == max`` the range is the data's own
    min and max, which no device knows alone, so the operand stays whole."""
    low, high = arg(node, 2, "min"), arg(node, 3, "max")
    fixed_range = low is not None and high is not None and low < high
    f = FactorNamer()
    operand = tuple((f.new(s, blocked=not fixed_range),) if s != 1 else () for s in specs[0].shape)
    result = (f.new(node.outputs[0].shape[0], blocked=True),)
    reductions = tuple((fac, "sum") for dims in operand for fac in dims) if fixed_range else ()
    return f.rule([operand], [result], reductions=reductions)
