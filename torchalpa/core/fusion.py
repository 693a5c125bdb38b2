"""Memory traffic of a StableHLO step as XLA's fusion moves it, not op by op.

StableHLO spells layer norm, softmax, GELU and the losses (and their backwards) as chains
of elementwise ops and reductions, which XLA fuses into a few kernels that read their
inputs once and write only what is used outside the chain. The ATen graph of the same
step has one op per chain (``native_layer_norm``, ``_softmax``, ``gelu``...) whose bytes
are its inputs and outputs. Charging every link of a StableHLO chain its own reads and
writes counts each intermediate twice and makes the same step look memory bound several
times over: ``benchmarks/stablehlo_crosscheck.py --detail`` on the tiny GPT showed 8.4 MB
of elementwise traffic from StableHLO against 2.1 MB from ATen, and a compute estimate
3.3 times ATen's.

The rule (XLA's loop and input fusion, simplified): a value is *fused*, never written to
memory, when its producer is an elementwise op (``FUSIBLE``), it is not a result of the
step, and every op that reads it is elementwise or a reduction. A fused value's write is
dropped from its producer's bytes and its read from each reader's bytes. Views (reshape,
permute, expand) move no bytes and are looked through. Flops are unchanged, and so is
everything a sharding rule reads: only ``OpNode.bytes`` changes.

A fused value read by an op of another phase (forward's value read in backward) is not in
that op's kernel. With ``reread=True`` such a value is written (kept for that phase)
unless the written values it is made from (its *sources*, through other fused values) are
no larger, as a compiler's partitioner saves the smaller; then the later reader is charged
the sources' bytes instead (a compiled cross-entropy's backward reads the 16-bit logits,
not a float32 log-softmax forward never wrote), and a residual stream kept for backward is
written. XLA's StableHLO steps keep the default (off).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from torchalpa.core.opgraph import GraphOutputs, OpNode, ValueRef

__all__ = ["fuse_elementwise_bytes", "view_walkers", "STEP_RESULT", "FUSIBLE", "REDUCTIONS"]

FUSIBLE = frozenset({
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor",
    "aten.maximum.default", "aten.minimum.default", "aten.neg.default", "aten.exp.default",
    "aten.log.default", "aten.sqrt.default", "aten.rsqrt.default", "aten.tanh.default",
    "aten.sigmoid.default", "aten.abs.default", "aten.pow.Tensor_Tensor", "aten.sin.default",
    "aten.cos.default", "aten.erf.default", "aten.log1p.default", "aten.expm1.default",
    "aten.sign.default", "aten.floor.default", "aten.ceil.default", "aten.remainder.Tensor",
    "aten.where.self", "aten.clamp.Tensor", "aten.logical_and.default",
    "aten.logical_or.default", "aten.logical_xor.default", "aten.logical_not.default",
    "aten.bitwise_not.default", "aten.round.default", "aten.eq.Tensor", "aten.ne.Tensor",
    "aten.lt.Tensor", "aten.le.Tensor", "aten.gt.Tensor", "aten.ge.Tensor",
    "aten._to_copy.default", "aten.full.default", "aten.arange.default",
})
REDUCTIONS = frozenset({"aten.sum.dim_IntList", "aten.amax.default", "aten.amin.default",
                        "aten.all.dim", "aten.any.dims"})
STEP_RESULT = "<step result>"


def view_walkers(nodes: list[OpNode], outputs: GraphOutputs):
    """(nodes by name, the final readers of a value, the value a chain of views starts
    from)."""
    by_name = {n.name: n for n in nodes}
    readers: dict[ValueRef, list[str]] = {}
    for n in nodes:
        for ref in n.operands:
            readers.setdefault(ref, []).append(n.name)
    results = set(outputs.refs())

    def final_readers(ref: ValueRef) -> list[str]:
        """The non-view ops that read ``ref``, through views; ``STEP_RESULT`` for a result."""
        found = [STEP_RESULT] if ref in results else []
        for name in readers.get(ref, []):
            found += final_readers(ValueRef(name)) if by_name[name].aliases else [name]
        return found

    def root(ref: ValueRef) -> ValueRef:
        """The value a chain of views starts from."""
        while by_name[ref.node].aliases and by_name[ref.node].operands:
            ref = by_name[ref.node].operands[0]
        return ref
    return by_name, final_readers, root


def fuse_elementwise_bytes(nodes: list[OpNode], outputs: GraphOutputs,
                           fusible: Callable[[str], bool] = FUSIBLE.__contains__,
                           reduces: Callable[[str], bool] = REDUCTIONS.__contains__,
                           *, pointwise: Callable[[OpNode], bool] | None = None,
                           reads_nothing: Callable[[OpNode], bool] | None = None,
                           reread: bool = False) -> list[OpNode]:
    """``nodes`` with the bytes of fused values taken off their producers and readers.
    ``fusible`` / ``reduces``: which ops are elementwise / reductions (StableHLO's
    spellings by default; ``passes/pricing/fused_pricing.py`` passes ATen's);
    ``pointwise``: which nodes fuse with their readers, where an op's name does not say
    (default: ``fusible`` of the op); ``reads_nothing``: fusible nodes whose operands lend
    a shape only (fills); ``reread``: a reader in another phase than a fused value's
    producer reads its sources instead (module doc)."""
    by_name, final_readers, root = view_walkers(nodes, outputs)
    is_pointwise = pointwise or (lambda n: fusible(n.op))
    lends_shape = reads_nothing or (lambda n: False)
    fused: dict[ValueRef, bool] = {}

    def is_fused(ref: ValueRef) -> bool:
        if ref not in fused:
            node, reads = by_name[ref.node], final_readers(ref)
            fused[ref] = is_pointwise(node) and bool(reads) and all(
                r != STEP_RESULT and (is_pointwise(by_name[r]) or reduces(by_name[r].op))
                for r in reads)
            if fused[ref] and reread and any(by_name[r].phase != node.phase for r in reads):
                # kept for a later phase: written, unless what it is computed from is no
                # larger (the compiler saves that and computes it again where it is read)
                fused[ref] = sum(size(s) for s in made_of(ref)) <= size(ref)
        return fused[ref]

    made_from: dict[ValueRef, tuple[ValueRef, ...]] = {}

    def made_of(ref: ValueRef) -> tuple[ValueRef, ...]:
        """The written values (roots of views) ``ref``'s op computes it from."""
        if ref not in made_from:
            node = by_name[ref.node]
            found: dict[ValueRef, None] = {}
            for operand in () if lends_shape(node) else node.operands:
                found.update(dict.fromkeys(sources(root(operand))))
            made_from[ref] = tuple(found)
        return made_from[ref]

    def sources(ref: ValueRef) -> tuple[ValueRef, ...]:
        """The written values (roots of views) a value is computed from: itself if written."""
        return made_of(ref) if is_fused(ref) else (ref,)

    def size(ref: ValueRef) -> int:
        return by_name[ref.node].outputs[ref.index].nbytes

    def read_bytes(n: OpNode) -> int:
        direct, again = 0, {}
        for ref in () if lends_shape(n) else n.operands:
            base = root(ref)
            if not is_fused(base):
                direct += size(ref)
            elif reread and by_name[base.node].phase != n.phase:
                again.update(dict.fromkeys(sources(base)))
        return direct + sum(size(s) for s in again)

    out = []
    for n in nodes:
        if n.is_leaf or n.aliases:
            out.append(n)
            continue
        writes = sum(0 if is_fused(ValueRef(n.name, i)) else spec.nbytes
                     for i, spec in enumerate(n.outputs))
        out.append(replace(n, bytes=float(read_bytes(n) + writes)))
    return out
