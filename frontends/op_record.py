"""The ops a step dispatches, recorded on ``meta`` tensors without tracing.

``make_fx`` spends most of a capture recording proxies and fake tensors for each op; the
same Python run eagerly on ``meta`` tensors costs about a tenth of it (LLaMA-3-70B's joint
step at 8 layers: 0.18 s against 1.7 s CPU). ``record_ops`` runs a function that way under
a dispatch mode that decomposes as the capture's trace does (the capture's decomposition
table first, then an op's CompositeImplicit kernel) and keeps, per op that ran, what a
traced graph's node would hold: the op, its arguments that are not tensors, and the shapes
of its tensor arguments and results (``RecordedOp``).

Two such records of one step at two batch sizes show every number the step computes from
the batch (``frontends/rebatch_check.py`` compares them to vouch for a derived micro-batch
step without a second trace).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, autograd_would_have_decomposed
from torch.utils._pytree import tree_flatten

from torchalpa.frontends.meta_memo import MetaMemo

__all__ = ["RecordedOp", "record_ops", "op_args", "flat_leaves", "DEVICE"]

DEVICE = "<device>"
"""What a device argument is recorded as: a step recorded on ``meta`` beside one traced on
another device still reads alike, and no device depends on the batch."""


@dataclass(frozen=True, slots=True)
class RecordedOp:
    """One op a step ran: ``args``, its arguments with every tensor as its shape (a
    ``tuple`` of ints) and every device as ``DEVICE``; ``out``, its results' shapes."""

    target: Any
    args: tuple
    out: tuple


def op_args(args: Any, shape_of: Callable[[Any], tuple | None]) -> tuple:
    """The flattened arguments of an op as ``RecordedOp`` keeps them; ``shape_of`` gives a
    tensor-like leaf's shape (None: not one)."""
    kept = []
    for a in flat_leaves(args):
        shape = shape_of(a)
        if shape is not None:
            kept.append(("tensor", shape))
        elif isinstance(a, torch.device):
            kept.append(DEVICE)
        else:
            kept.append(a)
    return tuple(kept)


_LEAVES = (torch.Tensor, int, float, complex, str, type(None), torch.dtype, torch.device,
           torch.layout, torch.memory_format)
"""Leaves of an op's arguments that pytree would keep whole (no registered node type)."""


def flat_leaves(tree: Any) -> list:
    """``tree_flatten(tree)[0]`` for what op arguments are made of -- tuples, lists and dicts
    of tensors, numbers, dtypes and devices -- without pytree's bookkeeping per node (two
    thirds of a record's own work); anything else is flattened by pytree itself."""
    leaves: list = []
    _flatten_into(tree, leaves)
    return leaves


def _flatten_into(tree: Any, leaves: list) -> None:
    kind = type(tree)
    if kind is tuple or kind is list:
        for item in tree:
            _flatten_into(item, leaves)
    elif kind is dict:
        for item in tree.values():
            _flatten_into(item, leaves)
    elif isinstance(tree, _LEAVES):
        leaves.append(tree)
    else:
        leaves.extend(tree_flatten(tree)[0])


def _tensor_shape(a: Any) -> tuple | None:
    return tuple(a.shape) if isinstance(a, torch.Tensor) else None


_NOT_DECOMPOSED = (torch.ops.aten.size.default, torch.ops.aten.stride.default,
                   torch.ops.aten.storage_offset.default)
"""Ops ``make_fx`` never decomposes (as torch's ``proxy_call``)."""


class _Recorder(TorchDispatchMode):
    """Run each op on meta tensors, decomposed as ``make_fx`` decomposes it (the table,
    then a CompositeImplicit kernel where autograd would have used it), and keep it."""

    def __init__(self, table: Mapping):
        super().__init__()
        self.table = table
        self.ops: list[RecordedOp] = []
        self.memo = MetaMemo()     # identical layers: each distinct op call runs once

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        decomposition = self.table.get(func)
        if decomposition is not None:
            with self:
                out = decomposition(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if func not in _NOT_DECOMPOSED and autograd_would_have_decomposed(
                func, flat_leaves((args, kwargs))):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = self.memo(func, args, kwargs)
        self.ops.append(RecordedOp(func, op_args((args, kwargs), _tensor_shape),
                                   op_args(out, _tensor_shape)))
        return out


def record_ops(fn: Callable, args: Sequence, table: Mapping) -> list[RecordedOp]:
    """The ops ``fn(*args)`` runs (``args`` on ``meta``), decomposed by ``table`` as a
    trace with that decomposition table decomposes them."""
    recorder = _Recorder(table)
    with recorder:
        fn(*args)
    return recorder.ops
