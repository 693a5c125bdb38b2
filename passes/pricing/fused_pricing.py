"""Price a torch graph's elementwise chains as a fusing compiler runs them.

Eager PyTorch runs every ATen op as its own kernel: RMSNorm's ``pow``, ``mean``, ``add``,
``rsqrt``, ``mul``, ``mul`` each read and write whole tensors, and the captured graph
prices them so (``OpNode.bytes``: inputs + outputs). Under ``torch.compile`` (the
runtime's ``compile=True``) Inductor fuses such chains into a few kernels, as XLA fuses
the same computation in a StableHLO program; a graph priced op by op then overstates a
compiled step's memory traffic (the tiny LLaMA's compute estimate x2.1 its StableHLO
export's, all of it in elementwise ops: ``benchmarks/stablehlo_crosscheck.py --detail``).

``AutoShardingOption(elementwise="fused")`` prices the torch graph with the rule the
StableHLO frontend applies (``torchalpa/core/fusion.py``: a value made by an elementwise op
and read only by elementwise ops and reductions is never written), ATen's ops sorted by
torch's own tags: ``Tag.pointwise`` ops are elementwise, ``Tag.reduction`` ops reductions,
and so are the softmax / log-softmax / layer-norm kernels and their backwards, which the
compiler lowers to reductions fused with their neighbours. The ops whose results a
compiled step never holds (``recomputed``, below: softmaxes, indexed loads, a scatter into
a fill) are written by none of the step's kernels either, and a reader in another phase
(backward reading forward's log-softmax) reads what they are computed from instead
(``fuse_elementwise_bytes(reread=True)``): a compiled cross-entropy moves its 16-bit
logits, not the float32 copy, log-softmax and one-hot gradient eager PyTorch writes. Flops, shapes and everything a
sharding rule reads stay as they are. A StableHLO program is priced as XLA fuses it
already and is returned unchanged.

What a compiled step holds (``recomputed``, read by ``passes/pricing/memory.py``): Inductor
lowers softmax and log-softmax (and their backwards) to row reductions and a pointwise
epilogue, ``gather`` to an indexed load, and a ``scatter`` into a fill (nll-loss's
backward: zeros with the target column set) to a pointwise select; its partitioner saves
for backward what is cheapest to keep and recomputes fused chains from it. So a value made
by such an op and read only by fusible ops is never held: its readers read the values it
is computed from (its sources), held instead until its last reader, where they are no
larger than it. The cross-entropy of a bf16 head under ``torch.compile`` keeps the bf16
logits for backward and one logit-sized gradient, not the float32 copy, log-softmax and
one-hot gradient that eager PyTorch allocates. This is ``torch.compile`` of a module
trained by autograd (one joint graph, as the published runs compiled theirs); the runtime's
``compile=True`` compiles its forward and backward programs apart, and a forward value its
backward program reads stays held as lowered (for the loss, the float32 log-softmax where
this counts the bf16 logits): not modeled, so such a plan's estimate is lower by that.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from torchalpa.core.fusion import (
    FUSIBLE,
    REDUCTIONS,
    STEP_RESULT,
    fuse_elementwise_bytes,
    view_walkers,
)
from torchalpa.core.opgraph import OpGraph, ValueRef

__all__ = ["priced_as", "ELEMENTWISE_MODES", "is_elementwise", "is_reduction", "recomputed"]

ELEMENTWISE_MODES = ("eager", "fused")
# fills: the compiler writes them inside the kernel that reads them
_FILLS = frozenset({"aten.full_like.default", "aten.zeros_like.default",
                    "aten.ones_like.default", "aten.scalar_tensor.default"})
# lowered by the compiler to reductions and pointwise ops it fuses with their readers
_NORMALIZATIONS = frozenset({
    "aten._softmax.default", "aten._softmax_backward_data.default",
    "aten._log_softmax.default", "aten._log_softmax_backward_data.default",
    "aten.native_layer_norm.default", "aten.native_layer_norm_backward.default",
    "aten.native_group_norm.default", "aten.native_group_norm_backward.default"})

# row reductions with a pointwise epilogue: their result fuses into elementwise readers
_SOFTMAXES = frozenset({
    "aten._softmax.default", "aten._softmax_backward_data.default",
    "aten._log_softmax.default", "aten._log_softmax_backward_data.default"})
_INDEXED = frozenset({"aten.gather.default"})          # an indexed load in the kernel
_SCATTERS = frozenset({"aten.scatter.value", "aten.scatter.src"})


def _tags(op: str) -> tuple:
    """torch's tags of an ATen overload named ``aten.name.overload`` (none otherwise)."""
    namespace, _, rest = op.partition(".")
    name, _, overload = rest.partition(".")
    if namespace != "aten" or not name or not overload:
        return ()
    packet = getattr(torch.ops.aten, name, None)
    overload_op = getattr(packet, overload, None) if packet is not None else None
    return tuple(getattr(overload_op, "tags", ()))


@lru_cache(maxsize=4096)
def is_elementwise(op: str) -> bool:
    """Whether a fusing compiler writes ``op``'s result only where a non-fusable op needs it."""
    return op in FUSIBLE or op in _FILLS or torch.Tag.pointwise in _tags(op)


@lru_cache(maxsize=4096)
def is_reduction(op: str) -> bool:
    """Whether ``op`` reads elementwise producers inside its own kernel once compiled."""
    return op in REDUCTIONS or op in _NORMALIZATIONS or torch.Tag.reduction in _tags(op)


def priced_as(graph: OpGraph, elementwise: str) -> OpGraph:
    """``graph`` with its ops' bytes as the ``elementwise`` mode runs them: "eager" (as
    captured) or "fused" (module doc)."""
    if elementwise not in ELEMENTWISE_MODES:
        raise ValueError(f"elementwise must be one of {ELEMENTWISE_MODES}, got {elementwise!r}")
    if elementwise == "eager" or graph.meta.get("frontend") == "stablehlo":
        return graph
    by_name, _, root = _kernel_nodes(graph)
    nodes = fuse_elementwise_bytes(list(graph), graph.outputs, is_elementwise, is_reduction,
                                   pointwise=_pointwise(by_name, root),
                                   reads_nothing=lambda n: n.op in _FILLS, reread=True)
    return OpGraph(nodes, graph.outputs, meta=dict(graph.meta, elementwise=elementwise))


def _pointwise(by_name, root):
    """Whether a node's result fuses into its readers' kernels once compiled: pointwise
    ops, softmaxes (a row reduction with a pointwise epilogue), an indexed load, a scatter
    into a fill (a select). The one rule for the step's bytes (``priced_as``) and what it
    holds (``recomputed``)."""
    def pointwise(n) -> bool:
        return is_elementwise(n.op) or n.op in _SOFTMAXES or n.op in _INDEXED or (
            n.op in _SCATTERS and bool(n.operands) and
            by_name[root(n.operands[0]).node].op in _FILLS)
    return pointwise


def _kernel_nodes(graph: OpGraph):
    """(by name, final readers of every result of a node through views, the value a view
    starts from): core.fusion's walkers over the whole graph."""
    by_name, final_readers, root = view_walkers(list(graph), graph.outputs)

    def node_readers(name: str) -> list[str]:
        return [r for i in range(len(by_name[name].outputs))
                for r in final_readers(ValueRef(name, i))]
    return by_name, node_readers, root


def recomputed(graph: OpGraph) -> dict[str, tuple[ValueRef, ...]]:
    """Ops whose results a compiled step never holds (module doc) -> the values they are
    computed from (roots of views, through other such ops; parameters and buffers, held
    anyway, left out). Empty for a StableHLO program (priced as XLA runs it)."""
    if graph.meta.get("frontend") == "stablehlo":
        return {}
    by_name, final_readers, root = _kernel_nodes(graph)

    def is_fill(name: str) -> bool:
        return by_name[name].op in _FILLS

    pointwise = _pointwise(by_name, root)

    def fuses(name: str) -> bool:
        return name != STEP_RESULT and (pointwise(by_name[name]) or is_reduction(by_name[name].op))

    out: dict[str, tuple[ValueRef, ...]] = {}
    for n in graph:
        if n.kind != "op" or n.aliases or not pointwise(n):
            continue
        reads = final_readers(n.name)
        if not reads or not all(fuses(r) for r in reads):
            continue
        sources: dict[ValueRef, None] = {}
        for ref in () if is_fill(n.name) else n.operands:      # a fill reads a shape
            base = root(ref)
            for src in out.get(base.node, (base,)):
                if by_name[src.node].kind in ("op", "input"):
                    sources[src] = None
        held = sum(by_name[s.node].outputs[s.index].nbytes for s in sources)
        if held <= sum(o.nbytes for o in n.outputs):
            out[n.name] = tuple(sources)
    return out
