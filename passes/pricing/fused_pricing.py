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
compiler lowers to reductions fused with their neighbours. Flops, shapes and everything a
sharding rule reads stay as they are. A StableHLO program is priced as XLA fuses it
already and is returned unchanged.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from torchalpa.core.fusion import FUSIBLE, REDUCTIONS, fuse_elementwise_bytes
from torchalpa.core.opgraph import OpGraph

__all__ = ["priced_as", "ELEMENTWISE_MODES", "is_elementwise", "is_reduction"]

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
    nodes = fuse_elementwise_bytes(list(graph), graph.outputs, is_elementwise, is_reduction)
    return OpGraph(nodes, graph.outputs, meta=dict(graph.meta, elementwise=elementwise))
