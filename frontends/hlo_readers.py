"""What each StableHLO op reads as: one reader per op name, registered in ``READERS``.

``frontends/stablehlo.py`` walks a function body; for an op that is not a call, a constant
or an identity it looks its name up here. A reader returns the op's result (a ``ValueRef``,
or a list for several results) in the ATen vocabulary the torch frontend produces, or
None when this instance of the op has no ATen counterpart (a gather that is neither an
embedding lookup nor a pick along a dim): the op then keeps its StableHLO name, has no
sharding rule and is listed in the plan. To read a new op, add a function decorated with
``@reads("stablehlo.name")``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torchalpa.core.opgraph import Operand, OpNode, TensorSpec, ValueRef
from torchalpa.frontends.hlo_dot import emit_batch_sum, emit_dot
from torchalpa.frontends.hlo_gather import add_along_dim, pick_along_dim

__all__ = ["READERS", "OpAt", "StableHLOError", "ELEMENTWISE", "COMPARE", "REDUCE", "ints_of", "dot_dims_of",
           "gather_dims_of"]

class StableHLOError(ValueError):
    """The StableHLO program is not a training step torchalpa can read; says why."""


# StableHLO elementwise op -> the ATen op with the same sharding rule.
ELEMENTWISE = {
    "stablehlo.add": "aten.add.Tensor", "stablehlo.subtract": "aten.sub.Tensor",
    "stablehlo.multiply": "aten.mul.Tensor", "stablehlo.divide": "aten.div.Tensor",
    "stablehlo.maximum": "aten.maximum.default", "stablehlo.minimum": "aten.minimum.default",
    "stablehlo.negate": "aten.neg.default", "stablehlo.exponential": "aten.exp.default",
    "stablehlo.log": "aten.log.default", "stablehlo.sqrt": "aten.sqrt.default",
    "stablehlo.rsqrt": "aten.rsqrt.default", "stablehlo.tanh": "aten.tanh.default",
    "stablehlo.logistic": "aten.sigmoid.default", "stablehlo.abs": "aten.abs.default",
    "stablehlo.power": "aten.pow.Tensor_Tensor", "stablehlo.sine": "aten.sin.default",
    "stablehlo.cosine": "aten.cos.default", "chlo.erf": "aten.erf.default",
    "stablehlo.log_plus_one": "aten.log1p.default",
    "stablehlo.exponential_minus_one": "aten.expm1.default",
    "stablehlo.sign": "aten.sign.default", "stablehlo.floor": "aten.floor.default",
    "stablehlo.ceil": "aten.ceil.default", "stablehlo.remainder": "aten.remainder.Tensor",
    "stablehlo.select": "aten.where.self", "stablehlo.clamp": "aten.clamp.Tensor",
    "stablehlo.and": "aten.logical_and.default", "stablehlo.or": "aten.logical_or.default",
    "stablehlo.xor": "aten.logical_xor.default", "stablehlo.not": "aten.logical_not.default",
    "stablehlo.round_nearest_even": "aten.round.default",
}
COMPARE = {"EQ": "aten.eq.Tensor", "NE": "aten.ne.Tensor", "LT": "aten.lt.Tensor",
            "LE": "aten.le.Tensor", "GT": "aten.gt.Tensor", "GE": "aten.ge.Tensor"}
REDUCE = {"stablehlo.add": "aten.sum.dim_IntList", "stablehlo.maximum": "aten.amax.default",
           "stablehlo.minimum": "aten.amin.default", "stablehlo.and": "aten.all.dim",
           "stablehlo.or": "aten.any.dims"}

# -- attribute text -------------------------------------------------------------------

def ints_of(text: str) -> list[int]:
    """Integers of ``array<i64: 1, 0>``, ``dense<[1, 0]> : tensor<2xi64>`` or ``[1, 0]``."""
    text = text.split(">", 1)[0] if text.startswith("array<") else text
    text = text.split(":", 1)[1] if text.startswith("array<") and ":" in text else \
        ("" if text.startswith("array<") else text.split(" : ")[0])
    return [int(v) for v in re.findall(r"-?\d+", text)]


def dot_dims_of(text: str) -> dict[str, list[int]]:
    """The batching and contracting dims of ``#stablehlo.dot<...>`` (absent: [])."""
    out = {}
    for key in ("lhs_batching_dimensions", "rhs_batching_dimensions",
                "lhs_contracting_dimensions", "rhs_contracting_dimensions"):
        m = re.search(key + r"\s*=\s*\[([^\]]*)\]", text)
        out[key] = [int(v) for v in re.findall(r"-?\d+", m.group(1))] if m else []
    return out


def gather_dims_of(text: str) -> dict[str, list[int]]:
    """The fields of ``#stablehlo.gather<...>`` / ``#stablehlo.scatter<...>`` (absent: [])."""
    out = {}
    for key in ("offset_dims", "collapsed_slice_dims", "start_index_map", "index_vector_dim",
                "operand_batching_dims", "start_indices_batching_dims", "update_window_dims",
                "inserted_window_dims", "scatter_dims_to_operand_dims", "input_batching_dims"):
        m = re.search(r"\b" + key + r"\s*=\s*(\[[^\]]*\]|-?\d+)", text)
        out[key] = [int(v) for v in re.findall(r"-?\d+", m.group(1))] if m else []
    return out



@dataclass
class OpAt:
    """One StableHLO op being read: the op, its name and source, its result specs, its
    operands (MLIR values) and, once read, the refs they stand for."""
    op: Any
    name: str
    source: str
    stack: str
    outs: list[TensorSpec]
    ins: list
    refs: list[ValueRef] = field(default_factory=list)


class Reader(Protocol):
    """What readers use of ``frontends/stablehlo.py``'s reader (and what the dot and
    gather emitters they call use of it)."""
    refs: dict
    constants: dict
    by_name: dict[str, OpNode]

    def emit(self, op: str, operands: list[ValueRef], out: TensorSpec | Sequence[TensorSpec],
             args: tuple = (), kwargs: tuple = (), *, source, stack="", flops=None
             ) -> ValueRef: ...

    def spec(self, ref: ValueRef) -> TensorSpec: ...

    def view(self, ref: ValueRef, shape, source, stack) -> ValueRef: ...

    def permute(self, ref: ValueRef, perm, source, stack) -> ValueRef: ...

    def broadcast(self, ref: ValueRef, dims, shape, source, stack) -> ValueRef: ...

    def reduce_body(self, op) -> str: ...

    def one_dim_slice(self, op, ref) -> tuple[int, int, int, int] | None: ...

    def embedding_lookup(self, op, refs) -> tuple[ValueRef, ValueRef] | None: ...

    def embedding_grad(self, op, ins, refs) -> tuple[ValueRef, ValueRef] | None: ...


ReadFn = Callable[[Reader, OpAt], "ValueRef | list[ValueRef] | None"]
READERS: dict[str, ReadFn] = {}


def reads(*names: str) -> Callable[[ReadFn], ReadFn]:
    """Register a reader for the StableHLO ops ``names``."""
    def register(fn: ReadFn) -> ReadFn:
        for name in names:
            READERS[name] = fn
        return fn
    return register


def _emit(r: Reader, at: OpAt, target: str, refs: list[ValueRef], args: tuple,
          kwargs: tuple = (), **extra) -> ValueRef:
    return r.emit(target, refs, at.outs[0], args, kwargs, source=at.source, stack=at.stack,
                  **extra)


@reads(*ELEMENTWISE, "stablehlo.compare")
def _elementwise(r: Reader, at: OpAt) -> ValueRef:
    """Pointwise ops; a constant operand is a scalar broadcast, as in ATen
    (``scalar_tensor``)."""
    refs = [r.emit("aten.full.default", [], TensorSpec((), r.spec(ref).dtype),
                   ((), r.constants[v]), source=at.source, stack=at.stack)
            if v in r.constants and r.spec(ref).shape else ref
            for v, ref in zip(at.ins, at.refs)]
    target = ELEMENTWISE.get(at.name)
    if at.name == "stablehlo.compare":
        found = re.search(r"comparison_direction (\w+)",
                          str(at.op.attributes["comparison_direction"]))
        if found is None:
            raise StableHLOError(f"cannot read the comparison of {at.op}")
        target = COMPARE[found.group(1)]
    if at.name == "stablehlo.clamp":        # clamp(min, x, max) -> clamp(x, min, max)
        refs = [refs[1], refs[0], refs[2]]
    if at.name == "stablehlo.not" and at.outs[0].dtype != "bool":
        target = "aten.bitwise_not.default"
    assert target is not None, f"{at.name} is elementwise"
    return _emit(r, at, target, refs, tuple(Operand(k) for k in range(len(refs))))


@reads("stablehlo.convert")
def _convert(r: Reader, at: OpAt) -> ValueRef:
    if r.spec(at.refs[0]).dtype == at.outs[0].dtype:
        return at.refs[0]          # a convert to its own element type is the identity
    return _emit(r, at, "aten._to_copy.default", at.refs, (Operand(0),),
                 (("dtype", f"torch.{at.outs[0].dtype}"),))


@reads("stablehlo.reshape")
def _reshape(r: Reader, at: OpAt) -> ValueRef:
    return r.view(at.refs[0], at.outs[0].shape, at.source, at.stack)


@reads("stablehlo.transpose")
def _transpose(r: Reader, at: OpAt) -> ValueRef:
    perm = ints_of(str(at.op.attributes["permutation"]))
    return r.permute(at.refs[0], perm, at.source, at.stack)


@reads("stablehlo.broadcast_in_dim")
def _broadcast_in_dim(r: Reader, at: OpAt) -> ValueRef:
    dims = ints_of(str(at.op.attributes["broadcast_dimensions"]))
    return r.broadcast(at.refs[0], dims, at.outs[0].shape, at.source, at.stack)


@reads("stablehlo.dot_general")
def _dot_general(r: Reader, at: OpAt) -> ValueRef:
    dims = dot_dims_of(str(at.op.attributes["dot_dimension_numbers"]))
    return emit_dot(r, at.refs, dims, at.outs[0], at.source, at.stack)


@reads("stablehlo.reduce")
def _reduce(r: Reader, at: OpAt) -> ValueRef | None:
    body = r.reduce_body(at.op)
    if len(at.ins) != 2 or body not in REDUCE:
        return None
    dims = ints_of(str(at.op.attributes["dimensions"]))
    if REDUCE[body] == "aten.sum.dim_IntList":
        summed = emit_batch_sum(r, at.refs[0], dims, at.source, at.stack)
        if summed is not None:
            return summed
    return _emit(r, at, REDUCE[body], at.refs[:1], (Operand(0), tuple(dims), False))


@reads("stablehlo.slice")
def _slice(r: Reader, at: OpAt) -> ValueRef | None:
    sliced = r.one_dim_slice(at.op, at.refs[0])
    if not sliced:
        return None
    dim, start, end, step = sliced
    return _emit(r, at, "aten.slice.Tensor", at.refs, (Operand(0), dim, start, end, step))


@reads("stablehlo.concatenate")
def _concatenate(r: Reader, at: OpAt) -> ValueRef:
    dim = int(ints_of(str(at.op.attributes["dimension"]))[0])
    return _emit(r, at, "aten.cat.default", at.refs,
                 (tuple(Operand(k) for k in range(len(at.refs))), dim))


@reads("stablehlo.gather")
def _gather(r: Reader, at: OpAt) -> ValueRef | None:
    found = r.embedding_lookup(at.op, at.refs)
    if found:
        return _emit(r, at, "aten.embedding.default", list(found), (Operand(0), Operand(1)),
                     flops=0.0)
    return pick_along_dim(r, at.op, at.refs, at.source, at.stack) or None


@reads("stablehlo.scatter")
def _scatter(r: Reader, at: OpAt) -> ValueRef | None:
    found = r.embedding_grad(at.op, at.ins, at.refs)
    if found:
        vocab = at.outs[0].shape[0]
        return _emit(r, at, "aten.embedding_dense_backward.default", list(found),
                     (Operand(0), Operand(1), vocab, -1, False))
    return add_along_dim(r, at.op, at.ins, at.refs, at.source, at.stack,
                         r.reduce_body(at.op)) or None


@reads("stablehlo.iota", "stablehlo.dynamic_iota")
def _iota(r: Reader, at: OpAt) -> ValueRef | None:
    if at.name == "stablehlo.dynamic_iota" and len(at.outs[0].shape) != 1:
        return None
    return _emit(r, at, "aten.arange.default", [], (at.outs[0].numel,))
