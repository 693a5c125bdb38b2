"""Ops driven by index tensors (gather, scatter, index_select, advanced indexing,
index_put, index_add) and by order (topk, sort).

Index values are global positions along the dim they address. ``gather`` and ``scatter*``
may still split that dim of the indexed tensor (Megatron's vocab-parallel cross entropy
picks each row's target log-probability from vocabulary-split logits): a device holding
a block translates the global positions with its block's offset and touches only the
positions it owns (``runtime/lowering/vocab.py``), so a gather leaves a Partial sum (zeros where
another device owns the position) and a scatter writes its own block. For the other ops
that dim is blocked: a device holding a block of it would read or write the wrong rows. The
index tensor's own dims shard freely: each device gathers (or scatters) its share of the
positions from a whole copy of the addressed dim. Scattering *adds* (scatter_add,
index_put with ``accumulate=True``, index_add) over a sharded index dim leave a Partial
sum, the tensor added into being an accumulator (Partial too, see ``FactorRule``);
scattering that *overwrites* cannot be split that way, so those index dims are blocked.
Other dims are shared by the operands when their sizes agree, else blocked.

``topk`` and ``sort`` order along one dim, which is blocked.
"""

from __future__ import annotations

from torchalpa.passes.rules.common import arg
from torchalpa.passes.rules.registry import FactorNamer, normalize_dim, register


def _shared_or_blocked(f: FactorNamer, sizes):
    """One factor shared by tensors whose dims all have the same size, else one blocked
    factor each (a dim of size 1 gets none)."""
    if all(s == sizes[0] for s in sizes):
        fac = (f.new(sizes[0]),) if sizes[0] != 1 else ()
        return [fac] * len(sizes)
    return [(f.new(s, blocked=True),) if s != 1 else () for s in sizes]


@register("aten.gather.default")
def gather(node, specs):
    shape, index = specs[0].shape, specs[1].shape
    dim = normalize_dim(arg(node, 1, "dim"), max(len(shape), 1))
    f = FactorNamer()
    self_dims, index_dims = [], []
    addressed = ()
    for d, (s, i) in enumerate(zip(shape, index)):
        if d == dim:
            addressed = (f.new(s),) if s != 1 else ()   # split: each device picks its own
            self_dims.append(addressed)
            index_dims.append((f.new(i),) if i != 1 else ())
        else:
            a, b = _shared_or_blocked(f, [s, i])
            self_dims.append(a)
            index_dims.append(b)
    return f.rule([tuple(self_dims), tuple(index_dims)], [tuple(index_dims)],
                  reductions=tuple((fac, "sum") for fac in addressed),
                  linear=(frozenset({0}),))


_ADDING_SCATTERS = {"aten.scatter_add.default"}


@register("aten.scatter.src", "aten.scatter.value", "aten.scatter_add.default",
          "aten.scatter_reduce.two")
def scatter(node, specs):
    shape, index = specs[0].shape, specs[1].shape
    has_src = len(specs) > 2
    src = specs[2].shape if has_src else index
    dim = normalize_dim(arg(node, 1, "dim"), max(len(shape), 1))
    adds = node.op in _ADDING_SCATTERS or (
        node.op == "aten.scatter_reduce.two" and arg(node, 4, "reduce") == "sum"
        and node.kwarg_dict.get("include_self", True))  # else touched rows drop self
    f = FactorNamer()
    self_dims, index_dims, src_dims = [], [], []
    for d, s in enumerate(shape):
        if d == dim:
            self_dims.append((f.new(s),) if s != 1 else ())   # split: each writes its own
            if adds:
                a, b = _shared_or_blocked(f, [index[d], src[d]])
            else:  # overwriting: which device's write wins is not a sum
                a, b = ((f.new(x, blocked=True),) if x != 1 else () for x in (index[d], src[d]))
            index_dims.append(a)
            src_dims.append(b)
        else:
            a, b, c = _shared_or_blocked(f, [s, index[d], src[d]])
            self_dims.append(a)
            index_dims.append(b)
            src_dims.append(c)
    out = tuple(self_dims)
    operands = [out, tuple(index_dims)] + ([tuple(src_dims)] if has_src else [])
    reductions, accumulators = (), frozenset()
    if adds:
        reductions = tuple((fac, "sum") for fac in index_dims[dim])
        accumulators = frozenset({0})
    if has_src:  # overwriting with src, or adding it: linear in (self, src) jointly
        linear = (frozenset({0, 2}),) if adds or node.op == "aten.scatter.src" else ()
    else:        # writing a constant: linear in self only if it writes zeros
        linear = (frozenset({0}),) if arg(node, 3, "value") == 0 else ()
    return f.rule(operands, [out], reductions=reductions, accumulators=accumulators,
                  linear=linear)


@register("aten.index_select.default")
def index_select(node, specs):
    shape, index = specs[0].shape, specs[1].shape
    dim = normalize_dim(arg(node, 1, "dim"), max(len(shape), 1))
    f = FactorNamer()
    dims = [(f.new(s, blocked=d == dim),) if s != 1 else () for d, s in enumerate(shape)]
    picked = f.dims(index)
    out = tuple(dims[:dim]) + (picked[0] if picked else (),) + tuple(dims[dim + 1:])
    if not shape:
        out = ()
    return f.rule([tuple(dims), picked], [out], linear=(frozenset({0}),))


@register("aten.index_add.default")
def index_add(node, specs):
    shape, index, source = specs[0].shape, specs[1].shape, specs[2].shape
    dim = normalize_dim(arg(node, 1, "dim"), max(len(shape), 1))
    f = FactorNamer()
    self_dims, source_dims = [], []
    picked = f.dims(index)
    for d, s in enumerate(shape):
        if d == dim:
            self_dims.append((f.new(s, blocked=True),) if s != 1 else ())
            source_dims.append(picked[0] if picked else ())
        else:
            a, b = _shared_or_blocked(f, [s, source[d]])
            self_dims.append(a)
            source_dims.append(b)
    reductions = tuple((fac, "sum") for dims in picked for fac in dims)
    return f.rule([tuple(self_dims), picked, tuple(source_dims)], [tuple(self_dims)],
                  reductions=reductions, accumulators=frozenset({0}),
                  linear=(frozenset({0, 2}),))


def _broadcast(shapes):
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for j in range(rank):
        sizes = [s[j - rank + len(s)] for s in shapes if j - rank + len(s) >= 0]
        out.append(max(sizes))
    return tuple(out)


class _Indexing:
    """``self[indices]`` for a list of optional index tensors (advanced indexing).

    The index tensors broadcast to shape B. If the indexed dims are adjacent, the result
    is ``self.shape[:first] + B + self.shape[last+1:]``; otherwise B comes first, then
    the dims that were not indexed. ``result`` / ``result_shape`` describe ``self[indices]``.
    """

    def __init__(self, f: FactorNamer, shape, entries, index_specs, block_index: bool):
        indexed = [i for i, e in enumerate(entries) if e is not None]
        shapes = [s.shape for s in index_specs]
        b = _broadcast(shapes)
        self.b = f.dims(b, blocked=block_index)
        self.index = [tuple(self.b[j + len(b) - len(s)] if size != 1 else ()
                            for j, size in enumerate(s)) for s in shapes]
        self.self_dims = tuple((f.new(s, blocked=d in indexed),) if s != 1 else ()
                               for d, s in enumerate(shape))
        kept = [d for d in range(len(shape)) if d not in indexed]
        if indexed == list(range(indexed[0], indexed[-1] + 1)):  # adjacent
            first, last = indexed[0], indexed[-1]
            self.result = self.self_dims[:first] + self.b + self.self_dims[last + 1:]
            self.result_shape = tuple(shape[:first]) + b + tuple(shape[last + 1:])
        else:
            self.result = self.b + tuple(self.self_dims[d] for d in kept)
            self.result_shape = b + tuple(shape[d] for d in kept)


def _entries(node):
    return tuple(arg(node, 1, "indices"))


@register("aten.index.Tensor")
def index(node, specs):
    f = FactorNamer()
    boolean = any(s.dtype == "bool" for s in specs[1:])
    ix = _Indexing(f, specs[0].shape, _entries(node), specs[1:], block_index=boolean)
    return f.rule([ix.self_dims] + ix.index, [ix.result], linear=(frozenset({0}),))


@register("aten.index_put.default", "aten.index_put_.default")
def index_put(node, specs):
    entries = _entries(node)
    num_index = sum(e is not None for e in entries)
    index_specs, values = specs[1:1 + num_index], specs[1 + num_index].shape
    accumulate = bool(arg(node, 3, "accumulate", False))
    f = FactorNamer()
    boolean = any(s.dtype == "bool" for s in index_specs)
    ix = _Indexing(f, specs[0].shape, entries, index_specs, block_index=boolean or not accumulate)
    # values broadcast against the shape of self[indices], aligned from the right
    offset = len(ix.result) - len(values)
    value_dims = tuple(ix.result[j + offset] if size == ix.result_shape[j + offset] else ()
                       for j, size in enumerate(values))
    reductions = tuple((fac, "sum") for dims in ix.b for fac in dims) if accumulate else ()
    return f.rule([ix.self_dims] + ix.index + [value_dims], [ix.self_dims],
                  reductions=reductions, linear=(frozenset({0, 1 + num_index}),),
                  accumulators=frozenset({0}) if accumulate else frozenset())


@register("aten.topk.default", "aten.sort.default", "aten.sort.stable")
def order(node, specs):
    shape = specs[0].shape
    index = 1 if node.op == "aten.sort.default" else 2
    if node.op == "aten.sort.stable":
        dim = node.kwarg_dict.get("dim", -1)
    else:
        dim = arg(node, index, "dim", -1)
    dim = normalize_dim(dim, max(len(shape), 1))
    f = FactorNamer()
    dims = tuple((f.new(s, blocked=d == dim),) if s != 1 else () for d, s in enumerate(shape))
    out_size = node.outputs[0].shape[dim] if shape else 1
    picked = (f.new(out_size, blocked=True),) if out_size != 1 else ()
    out = dims[:dim] + (picked,) + dims[dim + 1:] if shape else ()
    return f.rule([dims], [out, out])
