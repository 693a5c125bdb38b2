"""A ``gather`` / ``scatter`` that picks one element per row, in the ATen vocabulary.

Cross entropy picks each row's target log-probability: ATen records
``aten.gather(logp, 1, target.view(N, 1))`` and, in backward, a scatter into zeros.
torch-mlir writes the same pick as a ``stablehlo.gather`` whose index vector holds every
coordinate of the element: the position itself along each other dim (an ``iota``) and the
target along the picked one, concatenated on the index vector dim, with ``slice_sizes``
all 1 and every operand dim collapsed. JAX's ``take_along_axis`` names the other dims
batching dims instead (``operand_batching_dims``) and indexes the picked dim alone. The
gradient is a ``stablehlo.scatter``-add of the picked values' gradients with the same
indices into a zero table.

Read as ``aten.gather`` / ``aten.scatter_add`` along the picked dim, both frontends meet
the same rule (``passes/rules/index.py``): the vocabulary may stay split (each device
picks what it owns, a Partial sum), where an op without a rule would have gathered the
whole logits on every device. Any other gather or scatter is left as it is (no rule,
replicated and listed in the plan).
"""

from __future__ import annotations

import re
from typing import Protocol

from torchalpa.core.opgraph import Operand, TensorSpec, ValueRef

__all__ = ["pick_along_dim", "add_along_dim"]


class _Reader(Protocol):
    """What this module needs of ``frontends/stablehlo.py``'s reader."""

    refs: dict
    constants: dict

    def spec(self, ref: ValueRef) -> TensorSpec: ...

    def view(self, ref: ValueRef, shape, source, stack) -> ValueRef: ...

    def emit(self, op: str, operands: list[ValueRef], out: TensorSpec, args: tuple = (),
             kwargs: tuple = (), *, source, stack="", flops=None) -> ValueRef: ...


def _fields(text: str) -> dict[str, list[int]]:
    out = {}
    for key in ("offset_dims", "collapsed_slice_dims", "start_index_map", "index_vector_dim",
                "operand_batching_dims", "update_window_dims", "inserted_window_dims",
                "scatter_dims_to_operand_dims", "input_batching_dims",
                "start_indices_batching_dims", "scatter_indices_batching_dims"):
        m = re.search(r"\b" + key + r"\s*=\s*(\[[^\]]*\]|-?\d+)", text)
        out[key] = [int(v) for v in re.findall(r"-?\d+", m.group(1))] if m else []
    return out


def _owner(value):
    """The op that defines ``value``; None for a block argument."""
    owner = value.owner
    return getattr(owner, "operation", None) if hasattr(owner, "name") else None


def _picked_dim(indices, rank: int) -> tuple[int, object] | None:
    """For an index tensor ``(*B, rank)`` that concatenates, on its last dim, an ``iota``
    along batch dim k for each operand dim k but one: (that dim, its index value)."""
    concat = _owner(indices)
    if concat is None or concat.name != "stablehlo.concatenate" or \
            len(concat.operands) != rank:
        return None
    shape = [int(d) for d in re.findall(r"(\d+)x", str(indices.type))]
    if re.findall(r"\d+", str(concat.attributes["dimension"]))[:1] != [str(len(shape) - 1)]:
        return None
    picked = None
    for k, piece in enumerate(concat.operands):
        iota = _owner(piece)
        is_position = iota is not None and iota.name == "stablehlo.iota" and \
            re.findall(r"\d+", str(iota.attributes["iota_dimension"]))[:1] == [str(k)] and \
            k < len(shape) - 1
        if is_position:
            continue
        if picked is not None:
            return None
        picked = (k, piece)
    return picked


def _index_of(reader: _Reader, ins, refs, fields, rank: int, keys, source, stack):
    """(picked dim, index ref of the batch shape) of a gather/scatter that addresses one
    element per position, in either spelling, else None. ``keys``: the names of its
    (collapsed dims, dims the index vector maps to, operand batching dims, index batching
    dims) fields."""
    collapsed, mapped, batching, index_batching = (fields[k] for k in keys)
    index_shape = reader.spec(refs[1]).shape
    if fields["index_vector_dim"] != [len(index_shape) - 1] or len(index_shape) != rank + 1:
        return None
    batch = index_shape[:-1]
    if not batching and collapsed == list(range(rank)) == mapped:     # iota-concat form
        found = _picked_dim(ins[1], rank)
        if found is None:
            return None
        dim, piece = found
        return dim, reader.view(reader.refs[piece], batch, source, stack)
    others = [d for d in range(rank) if d not in collapsed]
    if len(collapsed) == 1 and mapped == collapsed and index_shape[-1] == 1 and \
            batching == others and index_batching == others:          # batching-dims form
        return collapsed[0], reader.view(refs[1], batch, source, stack)
    return None


def pick_along_dim(reader: _Reader, op, refs: list[ValueRef], source: str,
                   stack: str) -> ValueRef | None:
    """``aten.gather(x, dim, index)`` for a one-element-per-position ``gather``, else None."""
    rank = len(reader.spec(refs[0]).shape)
    fields = _fields(str(op.attributes["dimension_numbers"]))
    sizes = [int(v) for v in
             re.findall(r"-?\d+", str(op.attributes["slice_sizes"]).split(":")[-1])]
    if fields["offset_dims"] or sizes != [1] * rank:
        return None
    found = _index_of(reader, list(op.operands), refs, fields, rank,
                      ("collapsed_slice_dims", "start_index_map", "operand_batching_dims",
                       "start_indices_batching_dims"), source, stack)
    if found is None:
        return None
    dim, index = found
    return reader.emit("aten.gather.default", [refs[0], index],
                       TensorSpec(reader.spec(index).shape, reader.spec(refs[0]).dtype),
                       (Operand(0), dim, Operand(1)), source=source, stack=stack, flops=0.0)


def add_along_dim(reader: _Reader, op, ins, refs: list[ValueRef], source: str,
                  stack: str, body: str) -> ValueRef | None:
    """``aten.scatter_add(zeros, dim, index, src)`` for the gradient of such a gather (a
    scatter-add of one element per position into zeros), else None."""
    if len(ins) != 3 or body != "stablehlo.add" or reader.constants.get(ins[0]) != 0.0:
        return None
    rank = len(reader.spec(refs[0]).shape)
    fields = _fields(str(op.attributes["scatter_dimension_numbers"]))
    if fields["update_window_dims"]:
        return None
    found = _index_of(reader, ins, refs, fields, rank,
                      ("inserted_window_dims", "scatter_dims_to_operand_dims",
                       "input_batching_dims", "scatter_indices_batching_dims"), source, stack)
    if found is None:
        return None
    dim, index = found
    if reader.spec(refs[2]).shape != reader.spec(index).shape:
        return None
    return reader.emit("aten.scatter_add.default", [refs[0], index, refs[2]],
                       reader.spec(refs[0]), (Operand(0), dim, Operand(1), Operand(2)),
                       source=source, stack=stack)
