"""Reductions: reduced dims are reduction factors (Partial sum / avg when sharded)."""

from __future__ import annotations

from torchalpa.passes.rules import FactorNamer, normalize_dim, register

_KIND = {"aten.sum.dim_IntList": "sum", "aten.sum.default": "sum",
         "aten.mean.dim": "avg", "aten.mean.default": "avg"}


@register(*_KIND)
def reduction(node, specs):
    shape = specs[0].shape
    rank = len(shape)
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else None
    if dims is None or dims == ():
        reduced = set(range(rank))
    else:
        dims = dims if isinstance(dims, tuple) else (dims,)
        reduced = {normalize_dim(d, rank) for d in dims}
    keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwarg_dict.get("keepdim", False))
    f = FactorNamer()
    operand = f.dims(shape)
    result = []
    for d in range(rank):
        if d in reduced:
            if keepdim:
                result.append(())
        else:
            result.append(operand[d])
    op = _KIND[node.op]
    reductions = tuple((fac, op) for d in sorted(reduced) for fac in operand[d])
    # A Partial sum passes through sum and mean unchanged: both are linear.
    return f.rule([operand], [tuple(result)], reductions=reductions, linear=(frozenset({0}),))
