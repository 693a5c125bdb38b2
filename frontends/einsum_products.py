"""``torch.einsum`` of two operands that is a matrix product over several batch dims, traced
as ``torchalpa::batched_matmul``.

ATen computes ``einsum("bqhd,bkhd->bhqk", q, k)`` (Flax's and Alpa's attention) by permuting
both operands, merging their batch dims into one (``B * heads``), a ``bmm`` and a view
back: the merged dim can be split only by its leading factor, so the planner could shard
such attention by batch but never by heads, where the same product written with
``torch.matmul`` on ``(B, heads, S, hd)`` is split by heads (Megatron's layout). This module
writes the einsum as the matmul spelling writes it: each operand permuted to
``(*batch, free, contracted)`` / ``(*batch, contracted, free)``, one
``torchalpa::batched_matmul`` that keeps every batch dim its own dim, and the result
permuted to the equation's output order.

Only the form ``einsum("<a>,<b>-><out>", a, b)`` with explicit output, one letter per dim,
no letter repeated within an operand, two or more batch letters (in both operands and the
output, of equal sizes), and at least one free letter on each side and one contracted
letter is rewritten; every other einsum (broadcast batch dims, ``...``, a letter summed
inside one operand, three operands, one batch dim) is torch's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchalpa.ops import batched_matmul as bm

__all__ = ["BatchedProduct", "parse_batched_product", "einsum_as_batched_matmul"]


@dataclass(frozen=True)
class BatchedProduct:
    """The letters of a two-operand einsum, by role."""

    a: str              # the first operand's letters, in its dim order
    b: str
    out: str
    batch: str          # in both operands and the output
    free_a: str         # in the first operand and the output only
    contracted: str     # in both operands, not in the output
    free_b: str


def parse_batched_product(equation: str, a: torch.Tensor,
                          b: torch.Tensor) -> BatchedProduct | None:
    """The roles of the equation's letters, or None when it is not a product this module
    rewrites (see the module docstring)."""
    equation = equation.replace(" ", "")
    if "..." in equation or "->" not in equation:
        return None
    inputs, out = equation.split("->")
    operands = inputs.split(",")
    if len(operands) != 2:
        return None
    ea, eb = operands
    if not all(s.isalpha() and len(set(s)) == len(s) for s in (ea, eb)) or \
            not (out.isalpha() or out == "") or len(set(out)) != len(out):
        return None
    if len(ea) != a.dim() or len(eb) != b.dim() or set(out) - set(ea) - set(eb):
        return None
    if (set(ea) | set(eb)) - set(out) - (set(ea) & set(eb)):
        return None     # a letter summed inside one operand
    batch = "".join(c for c in out if c in ea and c in eb)
    free_a = "".join(c for c in out if c in ea and c not in eb)
    free_b = "".join(c for c in out if c in eb and c not in ea)
    contracted = "".join(c for c in ea if c in eb and c not in out)
    if len(batch) < 2 or not (free_a and free_b and contracted):
        return None
    if any(a.shape[ea.index(c)] != b.shape[eb.index(c)] for c in batch + contracted):
        return None     # broadcast (a size-1 dim against a larger one)
    return BatchedProduct(ea, eb, out, batch, free_a, contracted, free_b)


def einsum_as_batched_matmul(p: BatchedProduct, a: torch.Tensor,
                             b: torch.Tensor) -> torch.Tensor | None:
    """``torch.einsum`` of ``p`` on ``a``, ``b`` through one ``torchalpa::batched_matmul``,
    or None when the arranged operands are not a product it records."""
    size = {c: a.shape[i] for i, c in enumerate(p.a)} | {c: b.shape[i] for i, c in enumerate(p.b)}
    batch_sizes = [size[c] for c in p.batch]
    m, k, n = (math.prod(size[c] for c in s) for s in (p.free_a, p.contracted, p.free_b))
    lhs = _permuted(a, p.a, p.batch + p.free_a + p.contracted)
    rhs = _permuted(b, p.b, p.batch + p.contracted + p.free_b)
    lhs = _viewed(lhs, [*batch_sizes, m, k])
    rhs = _viewed(rhs, [*batch_sizes, k, n])
    if not bm.applies(lhs, rhs):
        return None
    y = bm.batched_matmul(lhs, rhs)                                  # (*batch, m, n)
    order = p.batch + p.free_a + p.free_b
    y = _viewed(y, [*batch_sizes, *(size[c] for c in p.free_a + p.free_b)])
    return _permuted(y, order, p.out)


def _permuted(t: torch.Tensor, letters: str, order: str) -> torch.Tensor:
    perm = [letters.index(c) for c in order]
    return t if perm == list(range(len(perm))) else t.permute(perm)


def _viewed(t: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return t if list(t.shape) == shape else t.reshape(shape)
