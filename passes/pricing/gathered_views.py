"""The gathered copy a forward view keeps for backward.

A view allocates nothing: the memory model (``passes/pricing/memory.py``) keeps the
storage it views alive until the view's last reader, priced in the layout that storage is
made in. A view that reads its operand in a larger layout than the operand is made in (an
all-gather of a value split by sequence, say) views the gathered copy instead, and where
backward reads the view (the input a weight's gradient reads, through a reshape or a chain
of transposes) the copy lives until then: the runtime's programs hand backward the view,
which holds the copy, as eager autograd would. This module finds those views and the
bytes such a copy adds at each point, so the ILP (``MemoryModel.kept_at``) and the plan's
estimate price the choice to keep a gathered copy rather than forbid it (Megatron's
sequence parallelism gathers again in backward instead, for the memory this prices; the
ATen graph writes some of these views as a ``clone``, an op whose result is priced in its
own layout anyway).

Between the view and the last read of its operand's storage by others (``ViewSpan.other``)
the copy is held beside the operand; after it, the operand is freed once the view made its
copy, where the model keeps it alive through the view: the copy adds its bytes less the
operand's there.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from torchalpa.core.opgraph import OpGraph, ValueRef
from torchalpa.core.placement import Placements
from torchalpa.passes.pricing.fused_pricing import recomputed
from torchalpa.passes.sharding.reshard import local_bytes

__all__ = ["ViewSpan", "saved_view_spans", "copy_bytes", "held_copies"]


@dataclass(frozen=True)
class ViewSpan:
    """A forward view of an activation that backward reads (through it or views of it):
    it reads ``operand`` at ``start`` (its place in the step); its storage is last read
    at ``end``; ``other``: the last read of the operand's storage by anything but the view
    and views of it (-1 when none)."""

    view: str
    operand: ValueRef
    start: int
    end: int
    other: int


def saved_view_spans(graph: OpGraph, fused: bool | None = None) -> list[ViewSpan]:
    """The forward views of activations that backward reads, in graph order. ``fused``:
    as ``memory.liveness`` takes it (a reader compiled kernels never hold is read until its
    own readers are)."""
    fused = graph.meta.get("elementwise") == "fused" if fused is None else fused
    recompute = recomputed(graph) if fused else {}
    order = {n.name: i for i, n in enumerate(graph)}
    readers: dict[str, list[str]] = defaultdict(list)
    for node in graph.ops():
        for ref in node.operands:
            readers[ref.node].append(node.name)
    for ref in graph.outputs.refs():
        readers[ref.node].append("")          # read at the end of the step
    views: dict[str, list[str]] = defaultdict(list)     # storage -> views of it
    for node in graph.ops():
        if node.aliases and node.operands:
            views[node.operands[0].node].append(node.name)
    memo: dict[str, int] = {}

    def read_at(reader: str) -> int:
        if reader == "":
            return len(order)
        if reader in recompute:
            if reader not in memo:
                memo[reader] = max([order[reader]] + [read_at(r) for r in readers[reader]])
            return memo[reader]
        return order[reader]

    def family(name: str, depth: int = 0) -> set[str]:
        """``name`` and the views of its storage through it."""
        out = {name}
        if depth < 16:
            for v in views[name]:
                out |= family(v, depth + 1)
        return out

    def last(names: set[str], skip: set[str]) -> int:
        return max((read_at(r) for n in names for r in readers[n] if r not in skip), default=-1)

    spans = []
    for node in graph.ops():
        if not (node.aliases and node.phase == "forward" and node.operands):
            continue
        mine = family(node.name)
        if not any(r and graph.node(r).phase != "forward" for n in mine for r in readers[n]):
            continue
        base = root = node.operands[0]
        while graph.node(root.node).aliases and graph.node(root.node).operands:
            root = graph.node(root.node).operands[0]
        if graph.node(root.node).kind not in ("op", "input"):
            continue                     # a view of a parameter: ``liveness`` keeps its own
        spans.append(ViewSpan(node.name, base, order[node.name], last(mine, set()),
                              last(family(root.node) - mine, mine)))
    return spans


def copy_bytes(span: ViewSpan, t: int, nbytes_src: float, nbytes_dst: float) -> float:
    """Bytes the view's copy (``nbytes_dst``, of an operand made in ``nbytes_src``) adds
    to the model at point ``t``: none outside the span or where the copy is no larger."""
    if not span.start <= t <= span.end or nbytes_dst <= nbytes_src:
        return 0.0
    return nbytes_dst if t <= span.other else nbytes_dst - nbytes_src


def held_copies(graph: OpGraph, spans: list[ViewSpan], outputs: dict[str, tuple],
                inputs: dict[str, tuple], mesh_shape) -> list[tuple[int, int, float]]:
    """(from, to, bytes) the views of ``spans`` add where they read their operand in a
    larger layout: ``outputs`` / ``inputs``, node -> the placements of its results / the
    layouts it reads its operands in."""
    out = []
    for span in spans:
        dst: Placements | None = inputs[span.view][0]
        if dst is None:
            continue
        spec = graph.spec(span.operand)
        src = local_bytes(spec, outputs[span.operand.node][span.operand.index], mesh_shape)
        whole = local_bytes(spec, dst, mesh_shape)
        if whole <= src:
            continue
        if span.other >= span.start:
            out.append((span.start, min(span.end, span.other), float(whole)))
        if span.end > span.other:
            out.append((max(span.start, span.other + 1), span.end, float(whole - src)))
    return out
