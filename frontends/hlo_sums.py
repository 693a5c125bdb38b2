"""Sum matrix products before adding anything else: ``(r + q) + k`` -> ``r + (q + k)``.

A layer input's gradient is the residual path's gradient plus one product per linear
that read the input (q, k and v in attention). A product whose contracted dim was sharded
is a Partial sum, and Partials may be added to each other and reduced once; adding a
replicated value first forces a reduction of every partial sum on its own. torch's
autograd accumulates the products first and the residual last, so the ATen plan reduces
once; torch-mlir's export of the same step adds the residual first (``((r + q) + k) + v``),
which cost the StableHLO plan of BERT one extra all-reduce per layer.

Addition is associative (up to rounding), so the reader reorders such chains: while a sum
``(r + s) + p`` adds a product ``p`` to a sum whose right term ``s`` is a product (or a
sum of products) and whose left term ``r`` is not, and nothing else reads ``r + s``, it
becomes ``r + (s + p)``. A *product* is a matrix product (``mm``, ``bmm``,
``batched_matmul``) seen through views. Only same-shape, same-dtype adds are touched.
"""

from __future__ import annotations

from dataclasses import replace

from torchalpa.core.opgraph import Operand, OpNode, ValueRef

__all__ = ["sum_products_first", "PRODUCTS"]

PRODUCTS = frozenset({"aten.mm.default", "aten.bmm.default",
                      "torchalpa.batched_matmul.default"})
_ADD = "aten.add.Tensor"


def sum_products_first(nodes: list[OpNode]) -> list[OpNode]:
    """``nodes`` (in order) with add chains reassociated so products are summed first."""
    nodes = list(nodes)
    changed = True
    while changed:
        changed = False
        by_name = {n.name: n for n in nodes}
        readers: dict[str, int] = {}
        for n in nodes:
            for ref in n.operands:
                readers[ref.node] = readers.get(ref.node, 0) + 1

        def spec(ref: ValueRef):
            return by_name[ref.node].outputs[ref.index]

        def is_products(ref: ValueRef) -> bool:
            node = by_name[ref.node]
            while node.aliases and node.operands:
                node = by_name[node.operands[0].node]
            if node.op in PRODUCTS:
                return True
            return _plain_add(node, spec) and all(is_products(r) for r in node.operands)

        for i, outer in enumerate(nodes):
            if not _plain_add(outer, spec):
                continue
            inner_ref, p = outer.operands
            inner = by_name[inner_ref.node]
            if not (_plain_add(inner, spec) and readers.get(inner.name) == 1
                    and is_products(p)):
                continue
            r, s = inner.operands
            if is_products(r) or not is_products(s):
                continue
            moved = replace(inner, operands=(s, p))              # s + p, now after p
            nodes[i] = replace(outer, operands=(r, ValueRef(moved.name)))
            del nodes[nodes.index(inner)]                        # before outer: outer at i-1
            nodes.insert(i - 1, moved)
            changed = True
            break
    return nodes


def _plain_add(node: OpNode, spec) -> bool:
    """An ``aten.add.Tensor`` of two values of its own shape and dtype (no alpha)."""
    return (node.op == _ADD and len(node.operands) == 2 and not node.kwargs
            and node.args == (Operand(0), Operand(1))
            and all(spec(r) == node.outputs[0] for r in node.operands))
