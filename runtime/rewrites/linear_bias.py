"""A linear layer's bias added inside its GEMM: ``add(mm(a, b), bias)`` runs as ``addmm``.

The capture decomposes ``addmm`` into ``mm`` and ``add`` (``frontends/opset.py``), so the
planner has one sharding rule per op. Run as captured, every linear layer's forward pays
one more elementwise kernel: a full read and write of its output and one more launch (6
per BERT layer, 4 per ViT or GPT layer). Eager ``F.linear`` adds the bias in the GEMM (on
CUDA, in cuBLASLt's epilogue). After lowering, where sharding is settled, this pass puts
``addmm`` back wherever the product and the bias are read exactly as computed (a plan step
that reshards either one stands between them, and the pair is left alone).

Not bit for bit the decomposed program: the GEMM adds the bias before rounding its result,
so the sum is rounded once instead of twice -- as eager PyTorch computes it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["fuse_linear_bias"]

aten = torch.ops.aten


def fuse_linear_bias(graph: fx.Graph, source_of: dict[fx.Node, fx.Node],
                     keep: frozenset[fx.Node] = frozenset()) -> int:
    """Rewrite each ``add(mm(a, b), bias)`` (either order) in place into ``addmm(bias, a,
    b)`` where ``bias`` is 1-D, the product 2-D with no other reader, and both of one dtype;
    returns how many. ``source_of``: local node -> the source node whose value it is
    (``meta["val"]`` there gives the global rank and dtype; a block keeps both), so a value
    the lowering made by a plan step (not in it) is never fused. Nodes in ``keep`` stay."""
    fused = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not aten.add.Tensor or n.kwargs \
                or len(n.args) != 2 or n in keep:
            continue
        for product, bias in (n.args, n.args[::-1]):
            if _fusable(product, bias, source_of, keep):
                assert isinstance(product, fx.Node) and isinstance(bias, fx.Node)
                with graph.inserting_before(n):
                    addmm = graph.call_function(aten.addmm.default, (bias, *product.args))
                n.replace_all_uses_with(addmm)
                graph.erase_node(n)
                graph.erase_node(product)
                fused += 1
                break
    return fused


def _fusable(product, bias, source_of: dict[fx.Node, fx.Node],
             keep: frozenset[fx.Node]) -> bool:
    """Whether ``product + bias`` is a linear layer's output that ``addmm`` computes."""
    if not (isinstance(product, fx.Node) and product.op == "call_function"
            and product.target is aten.mm.default and not product.kwargs
            and len(product.users) == 1 and product not in keep
            and isinstance(bias, fx.Node)):
        return False
    out, b = _value(product, source_of), _value(bias, source_of)
    return isinstance(out, torch.Tensor) and isinstance(b, torch.Tensor) \
        and out.dim() == 2 and b.dim() == 1 and b.dtype == out.dtype


def _value(n: fx.Node, source_of: dict[fx.Node, fx.Node]):
    source = source_of.get(n)
    return None if source is None else source.meta.get("val")
