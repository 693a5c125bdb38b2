"""``stablehlo.dot_general`` in the ATen vocabulary, batch dims kept apart where they can be.

A ``dot_general`` becomes what ``torch.matmul`` records for the same product, so both
frontends meet the same sharding rule (``passes/rules/matmul.py``):

- no batch dim: ``aten.mm`` on ``(rows, contracted) x (contracted, cols)``;
- one batch dim whose right operand is a matrix broadcast over it (torch-mlir's
  ``x (B, S, C) @ W``): ``aten.mm`` on ``(B * S, C) x W``, as ATen's ``linear`` records;
- and the sum over the batch of such a product's ``bmm`` (the weight's gradient) is one
  ``aten.mm`` (``emit_batch_sum``);
- one batch dim: ``aten.bmm`` on ``(batch, rows, contracted) x (batch, contracted, cols)``;
- two or more batch dims (JAX's ``einsum("bhqd,bhkd->bhqk")``):
  ``torchalpa::batched_matmul`` with every batch dim its own dim
  (``torchalpa/ops/batched_matmul.py``), as the torch frontend records ``q @ k.transpose``;
- one batch dim that is a merge of several (``B * H``): torch-mlir writes attention as
  ``reshape (B, H, S, D) -> (B * H, S, D)`` on both operands, a ``bmm`` and a reshape back.
  A merged dim can be split only by its leading factor, so that ``bmm`` could shard the
  batch but never the heads (Megatron's layout), and a StableHLO plan paid all-to-alls
  around attention that the ATen plan does not. When both operands are such merges of the
  same batch dims (through a transpose that keeps the merged dim first, as the backward's
  ``k^T`` is), the product reads the unmerged operands as ``torchalpa::batched_matmul``;
  the reader then folds the reshape back into the one it follows, so the heads stay a dim.
  Where the operands unmerge to different batch dims of one size (grouped-query attention
  repeats each kv head: ``(B, Hkv, rep)`` beside ``(B, H)``), both are viewed to the
  shorter, as torch's ``repeat_kv`` views ``(B, Hkv, rep, S, D)`` to ``(B, H, S, D)``.

Operands are brought to ``(*batch, rows, contracted)`` and ``(*batch, contracted, cols)``
with permutes and views, which move no bytes, and the product is viewed to the
``dot_general``'s result shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from torchalpa.core.opgraph import Operand, OpNode, TensorSpec, ValueRef
from torchalpa.ops.batched_matmul import BATCHED_MATMUL_OP

__all__ = ["emit_dot", "emit_batch_sum"]


class _Emitter(Protocol):
    """What ``emit_dot`` needs of the StableHLO reader (``frontends/stablehlo.py``)."""

    by_name: dict[str, OpNode]

    def spec(self, ref: ValueRef) -> TensorSpec: ...

    def emit(self, op: str, operands: list[ValueRef], out: TensorSpec, args: tuple = (),
             kwargs: tuple = (), *, source, stack="", flops=None) -> ValueRef: ...

    def view(self, ref: ValueRef, shape, source, stack) -> ValueRef: ...

    def permute(self, ref: ValueRef, perm, source, stack) -> ValueRef: ...


def emit_dot(reader: _Emitter, refs: Sequence[ValueRef], dims: dict[str, list[int]],
             out: TensorSpec, source: str, stack: str) -> ValueRef:
    """Emit the ops of one ``dot_general`` (``dims``: its dimension numbers); its result."""
    lhs, rhs = refs
    ls, rs = reader.spec(lhs).shape, reader.spec(rhs).shape
    lb, rb = dims["lhs_batching_dimensions"], dims["rhs_batching_dimensions"]
    lc, rc = dims["lhs_contracting_dimensions"], dims["rhs_contracting_dimensions"]
    lf = [d for d in range(len(ls)) if d not in lb + lc]
    rf = [d for d in range(len(rs)) if d not in rb + rc]
    m, k, n = (math.prod(ls[d] for d in lf), math.prod(ls[d] for d in lc),
               math.prod(rs[d] for d in rf))
    batch: tuple[int, ...] = tuple(ls[d] for d in lb)
    flops = 2.0 * math.prod(batch) * m * k * n
    if len(batch) > 1:                             # one dim per batch dim
        a = reader.view(reader.permute(lhs, lb + lf + lc, source, stack), batch + (m, k),
                         source, stack)
        w = reader.view(reader.permute(rhs, rb + rc + rf, source, stack), batch + (k, n),
                         source, stack)
        op = BATCHED_MATMUL_OP
    else:
        batch = (math.prod(batch),) if lb else ()
        a = reader.view(reader.permute(lhs, lb + lf + lc, source, stack), batch + (m, k),
                         source, stack)
        w = reader.view(reader.permute(rhs, rb + rc + rf, source, stack), batch + (k, n),
                         source, stack)
        op = "aten.bmm.default" if lb else "aten.mm.default"
        matrix = _unbatched(reader, w, source, stack) if lb else None
        if matrix is not None:                      # x (B, M, K) @ a broadcast weight
            rows = reader.view(a, (math.prod(batch) * m, k), source, stack)
            ref = reader.emit("aten.mm.default", [rows, matrix],
                              TensorSpec((math.prod(batch) * m, n), out.dtype),
                              (Operand(0), Operand(1)), source=source, stack=stack, flops=flops)
            return reader.view(ref, out.shape, source, stack)
        if lb:
            found_a, found_w = (_unmerged(reader, a, source, stack),
                                _unmerged(reader, w, source, stack))
            if found_a and found_w:
                (a, batch), (w, w_batch) = found_a, found_w
                if len(w_batch) < len(batch):      # grouped-query attention: k, v repeat
                    batch, w_batch = w_batch, batch  # kv heads (B, Hkv, rep): read as (B, H)
                a = reader.view(a, batch + reader.spec(a).shape[-2:], source, stack)
                w = reader.view(w, batch + reader.spec(w).shape[-2:], source, stack)
                op = BATCHED_MATMUL_OP
    product = TensorSpec(batch + (m, n), out.dtype)
    ref = reader.emit(op, [a, w], product, (Operand(0), Operand(1)), source=source,
                      stack=stack, flops=flops)
    return reader.view(ref, out.shape, source, stack)


def emit_batch_sum(reader: _Emitter, ref: ValueRef, dims: Sequence[int], source: str,
                   stack: str) -> ValueRef | None:
    """A sum over dim 0 of a ``bmm`` or its transpose (``sum_b A_b @ B_b``: the gradient of a weight that
    was broadcast over the batch) as one ``aten.mm`` of ``(P, B * M) x (B * M, Q)``, as
    ATen's ``linear`` backward records it; None for any other sum. The ``bmm`` is left to
    the reader's dead-op sweep when nothing else reads it."""
    node = reader.by_name[ref.node]
    if list(dims) != [0]:
        return None
    if node.op == "aten.permute.default" and tuple(node.args[1]) == (0, 2, 1):
        summed = emit_batch_sum(reader, node.operands[0], dims, source, stack)
        return None if summed is None else reader.permute(summed, (1, 0), source, stack)
    if node.op != "aten.bmm.default":
        return None
    lhs, rhs = node.operands
    (b, p, m), (_, _, q) = reader.spec(lhs).shape, reader.spec(rhs).shape
    a = reader.view(reader.permute(lhs, (1, 0, 2), source, stack), (p, b * m), source, stack)
    w = reader.view(rhs, (b * m, q), source, stack)
    return reader.emit("aten.mm.default", [a, w], TensorSpec((p, q), node.outputs[0].dtype),
                       (Operand(0), Operand(1)), source=source, stack=stack,
                       flops=node.flops)


def _unbatched(reader: _Emitter, ref: ValueRef, source: str, stack: str):
    """The ``(r, c)`` matrix when ``ref`` (``(b, r, c)``) broadcasts it over the batch
    (an expand of ``(1, r, c)``, possibly under a transpose of its last two dims); else None."""
    node = reader.by_name[ref.node]
    if node.op == "aten.expand.default":
        src = node.operands[0]
        shape = reader.spec(src).shape
        return reader.view(src, shape[1:], source, stack) if len(shape) == 3 and \
            shape[0] == 1 else None
    if node.op == "aten.permute.default" and tuple(node.args[1]) == (0, 2, 1):
        found = _unbatched(reader, node.operands[0], source, stack)
        return None if found is None else reader.permute(found, (1, 0), source, stack)
    return None


def _unmerged(reader: _Emitter, ref: ValueRef, source: str, stack: str):
    """``(source, batch)`` when ``ref`` (``(b, r, c)``) is a reshape of ``(*batch, r, c)``
    with two or more batch dims whose product is ``b``, possibly under a transpose that
    keeps dim 0 first (then the transpose is applied to the unmerged source); else None."""
    shape = reader.spec(ref).shape
    node = reader.by_name[ref.node]
    if node.op == "aten.reshape.default":
        src = node.operands[0]
        src_shape = reader.spec(src).shape
        nb = len(src_shape) - (len(shape) - 1)
        if nb >= 2 and src_shape[nb:] == shape[1:] and math.prod(src_shape[:nb]) == shape[0]:
            return src, tuple(src_shape[:nb])
        return None
    if node.op == "aten.permute.default":
        perm = node.args[1]
        if perm[0] != 0:
            return None
        found = _unmerged(reader, node.operands[0], source, stack)
        if found is None:
            return None
        src, batch = found
        nb = len(batch)
        moved = list(range(nb)) + [nb + p - 1 for p in perm[1:]]
        return reader.permute(src, moved, source, stack), batch
    return None
