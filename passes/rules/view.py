"""Shape ops: reshape (split and merged dims), permute/transpose, expand, (un)squeeze,
repeat.

A reshape is matched group by group: runs of input dims and output dims with equal
products. A dim split into several keeps them as its factors (major first), a merge is
the reverse; a regrouping (64x16 -> 32x32, tokens of a batch regrouped as MoE groups) gets
the common refinement of both sides, when it exists: 32x2x16 here, so the batch dim and
the group dim share their major factor and either can stay split. A group with no common
refinement (6x4 -> 4x6) gets factors that cannot be sharded. All are linear: a Partial
passes through.
"""

from __future__ import annotations

from torchalpa.passes.rules.registry import FactorNamer, normalize_dim, register

_LINEAR = (frozenset({0}),)


def _groups(src: tuple, dst: tuple):
    """Split src and dst dims into consecutive groups of equal product (size-1 dims alone)."""
    i = j = 0
    groups = []
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        gi, gj = [i], [j]
        ps, pd = src[i], dst[j]
        i += 1
        j += 1
        while ps != pd:
            if ps < pd:
                gi.append(i)
                ps *= src[i]
                i += 1
            else:
                gj.append(j)
                pd *= dst[j]
                j += 1
        groups.append((gi, gj))
    return groups


def _refinement(a: list[int], b: list[int]) -> list[int] | None:
    """Sizes (major first) of the coarsest factors both dim runs ``a`` and ``b`` (equal
    products) are made of, or None when a dim boundary of one side cuts a factor of the
    other unevenly (6x4 vs 4x6)."""
    total = 1
    for n in a:
        total *= n
    bounds = set()
    for run in (a, b):
        prefix = 1
        for n in run:
            prefix *= n
            bounds.add(prefix)
    atoms, previous = [], 1
    for bound in sorted(bounds):
        if bound % previous:
            return None
        atoms.append(bound // previous)
        previous = bound
    assert previous == total
    return atoms


@register("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")
def reshape(node, specs):
    src, dst = specs[0].shape, node.outputs[0].shape
    f = FactorNamer()
    in_dims: list = [()] * len(src)
    out_dims: list = [()] * len(dst)
    blocked, strided = set(), set()
    for gi, gj in _groups(src, dst):
        if not gi or not gj:
            continue  # a size-1 dim on one side: no factor
        if len(gi) == 1:            # one input dim -> one or more output dims (split)
            factors = tuple(f.new(dst[j]) for j in gj)
            in_dims[gi[0]] = factors
            for j, fac in zip(gj, factors):
                out_dims[j] = (fac,)
            strided |= _pieces_split(factors, [dst[j] for j in gj])
        elif len(gj) == 1:          # several input dims merge into one output dim
            factors = tuple(f.new(src[i]) for i in gi)
            out_dims[gj[0]] = factors
            for i, fac in zip(gi, factors):
                in_dims[i] = (fac,)
            strided |= _pieces_split(factors, [src[i] for i in gi])
        elif (atoms := _refinement([src[i] for i in gi], [dst[j] for j in gj])) is not None:
            factors = [f.new(size) for size in atoms]
            for dims, sizes, idx in ((in_dims, src, gi), (out_dims, dst, gj)):
                k = 0
                for i in idx:       # each dim is a run of consecutive atoms
                    run, prod = [], 1
                    while prod < sizes[i]:
                        run.append(factors[k])
                        prod *= atoms[k]
                        k += 1
                    dims[i] = tuple(run)
        else:                       # no clean factorization: keep these dims whole
            for i in gi:
                fac = f.new(src[i])
                blocked.add(fac)
                in_dims[i] = (fac,)
            for j in gj:
                fac = f.new(dst[j])
                blocked.add(fac)
                out_dims[j] = (fac,)
    return f.rule([tuple(in_dims)], [tuple(out_dims)], blocked=frozenset(blocked), linear=_LINEAR,
                  strided=frozenset(strided))


def _pieces_split(factors: tuple, sizes: list[int]) -> set:
    """A dim read as (pieces, heads, head dim), as timm's and many fused attentions view
    their q/k/v projection (``qkv.view(B, N, 3, H, D)``): the heads factor may be split as
    a strided shard of the whole dim (each device its heads of every piece). Two-factor
    views (heads, head dim) are left alone: splitting the head dim gains nothing."""
    if len(factors) >= 3 and 2 <= sizes[0] <= 8:
        return {factors[1]}
    return set()


def _permuted(node, specs, perm):
    f = FactorNamer()
    dims = f.dims(specs[0].shape)
    return f.rule([dims], [tuple(dims[p] for p in perm)], linear=_LINEAR)


@register("aten.permute.default")
def permute(node, specs):
    rank = len(specs[0].shape)
    return _permuted(node, specs, [normalize_dim(d, rank) for d in node.args[1]])


@register("aten.t.default")
def t(node, specs):
    return _permuted(node, specs, list(reversed(range(len(specs[0].shape)))))


@register("aten.transpose.int")
def transpose(node, specs):
    rank = len(specs[0].shape)
    a, b = normalize_dim(node.args[1], rank), normalize_dim(node.args[2], rank)
    perm = list(range(rank))
    perm[a], perm[b] = perm[b], perm[a]
    return _permuted(node, specs, perm)


@register("aten.expand.default")
def expand(node, specs):
    src, dst = specs[0].shape, node.outputs[0].shape
    f = FactorNamer()
    out = f.dims(dst)
    offset = len(dst) - len(src)
    operand = tuple(out[j + offset] if size == dst[j + offset] else () for j, size in enumerate(src))
    return f.rule([operand], [out], linear=_LINEAR)


@register("aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
          "aten.squeeze.default")
def squeeze_like(node, specs):
    # Only size-1 dims appear or vanish, so the non-unit dims line up in order.
    src, dst = specs[0].shape, node.outputs[0].shape
    f = FactorNamer()
    factors = [f.new(s) for s in src if s != 1]
    it = iter(factors)
    operand = tuple((next(it),) if s != 1 else () for s in src)
    it = iter(factors)
    result = tuple((next(it),) if s != 1 else () for s in dst)
    return f.rule([operand], [result], linear=_LINEAR)


@register("aten.repeat.default")
def repeat(node, specs):
    # Output dim d holds repeats[d] copies of input dim d: factors (copy, element), copy
    # major. Sharding the copy factor gives each device whole copies of a replicated input
    # (localize shrinks ``repeats``); the element factor is minor, so it can't shard the
    # output. New leading dims are all copies.
    src, dst = specs[0].shape, node.outputs[0].shape
    lead = len(dst) - len(src)
    f = FactorNamer()
    operand: list[tuple[str, ...]] = []
    result: list[tuple[str, ...]] = [(f.new(s),) if s != 1 else () for s in dst[:lead]]
    for d, size in enumerate(src):
        copies = dst[lead + d] // size if size else 1
        element = (f.new(size),) if size != 1 else ()
        operand.append(element)
        result.append(((f.new(copies),) if copies != 1 else ()) + element)
    return f.rule([tuple(operand)], [tuple(result)], linear=_LINEAR)
