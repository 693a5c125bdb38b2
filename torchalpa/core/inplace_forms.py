"""The ATen ops whose functional form is "copy ``self``, then write into the copy", with
the in-place op that writes into ``self`` itself.

A captured step is functional: where eager PyTorch writes into a buffer it has just made
-- ``nll_loss_backward`` fills a gradient with zeros and scatters ``-1`` into it, an
embedding's backward adds rows into a zeroed weight gradient -- the decomposed graph
shows ``full_like`` then an out-of-place ``scatter`` (``index_put``), a second buffer the
size of the first. Where nothing reads ``self`` after such an op, the runtime runs the
in-place op instead (``runtime/rewrites/write_in_place.py``), and the memory model prices
the op's result as ``self``'s storage, not a tensor of its own
(``passes/pricing/memory.py``, ``liveness``): both read this table, so the plan's memory
is what the runtime holds.

Only ops whose result has ``self``'s shape and dtype and whose out-of-place kernel is a
clone followed by the in-place one are listed (same values bit for bit). Elementwise ops
(``add``, ``mul``) are not: eager allocates their results, except where autograd
accumulates a gradient in place, which this table does not claim.
"""

from __future__ import annotations

__all__ = ["IN_PLACE_FORMS"]

IN_PLACE_FORMS: dict[str, str] = {
    "aten.scatter.value": "aten.scatter_.value",
    "aten.scatter.src": "aten.scatter_.src",
    "aten.scatter_add.default": "aten.scatter_add_.default",
    "aten.scatter_reduce.two": "aten.scatter_reduce_.two",
    "aten.index_put.default": "aten.index_put_.default",
    "aten.index_add.default": "aten.index_add_.default",
    "aten.index_copy.default": "aten.index_copy_.default",
}
"""Functional op (``OpNode.op``) -> the in-place op (``aten.<name>.<overload>``) that
writes its result into its first operand."""
