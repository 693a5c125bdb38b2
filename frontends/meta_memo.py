"""Meta-kernel results remembered by the layout of their arguments.

Deriving a micro-batch step (``frontends/rebatch.py``) and recording a step's ops
(``frontends/op_record.py``) run every op of the step on ``meta`` tensors. Many ops' meta
kernels are torch's Python references (``add``, ``mul``, ``pow``, ``sum``, ``cat``: about
0.2 ms a call, where a ``view`` costs 2 us), and a model's identical layers run the same
ops on arguments laid out the same way, layer after layer: at 32 layers each distinct
call runs 32 times. A meta kernel's result depends on nothing but its arguments' layouts
(shape, strides, storage offset and size, dtype, device) and the values of the arguments
that are not tensors, so ``MetaMemo`` runs each distinct call once and answers the others
with fresh tensors laid out as that result.

Only calls that are safe to answer that way are remembered: an ``OpOverload`` whose
schema mutates nothing and whose results alias no argument (a view must share its
input's storage, so views always run), every tensor argument on ``meta``, every other
argument a plain value (numbers keep their type in the key: ``mul(t, 2)`` and
``mul(t, 2.0)`` differ in dtype). Anything else runs as it would without the memo.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MetaMemo", "meta_like"]

_PLAIN = (int, float, bool, complex, str, type(None), torch.dtype, torch.device,
          torch.layout, torch.memory_format)
"""Argument values that go into a key as (type, value)."""


class _Unkeyable(Exception):
    """An argument the memo cannot key on (the call runs unremembered)."""


class MetaMemo:
    """``memo(op, args, kwargs)`` is ``op(*args, **kwargs)``, run once per distinct call;
    ``hits`` counts the calls answered from memory, ``runs`` the calls that ran."""

    def __init__(self):
        self.results: dict[tuple, Any] = {}
        self.hits = 0
        self.runs = 0

    def __call__(self, op: Any, args: tuple, kwargs: dict) -> Any:
        key = _key(op, args, kwargs)
        if key is None:
            self.runs += 1
            return op(*args, **kwargs)
        if key in self.results:
            self.hits += 1
            return meta_like(self.results[key])
        self.runs += 1
        out = op(*args, **kwargs)
        if _all_meta(out):
            # a copy of the layout: the caller may resize or write into ``out`` itself
            self.results[key] = meta_like(out)
        return out


def meta_like(value: Any) -> Any:
    """A fresh meta tensor laid out as ``value`` (the same shape, strides, storage offset,
    storage size and dtype), or a tuple / list of them; anything else as it is."""
    if isinstance(value, (list, tuple)):
        return type(value)(meta_like(v) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    numel = -(-value.untyped_storage().nbytes() // value.element_size())
    base = torch.empty(numel, dtype=value.dtype, device="meta")
    return base.as_strided(value.shape, value.stride(), value.storage_offset())


def _key(op: Any, args: tuple, kwargs: dict) -> tuple | None:
    """The call's key, or None where it is not to be remembered."""
    if not _fresh_results(op):
        return None
    try:
        return (op, _keyed(args), _keyed(tuple(sorted(kwargs.items()))))
    except _Unkeyable:
        return None


def _fresh_results(op: Any) -> bool:
    """Whether ``op`` is an ATen-style overload that writes nothing and whose every result
    is a new tensor (no alias of an argument); answered once per op."""
    known = _FRESH.get(op)
    if known is None:
        known = _FRESH[op] = _schema_fresh(op)
    return known


_FRESH: dict[Any, bool] = {}
"""op -> ``_schema_fresh(op)``."""


def _schema_fresh(op: Any) -> bool:
    if not isinstance(op, torch._ops.OpOverload):
        return False
    schema = op._schema
    return not schema.is_mutable and all(
        r.alias_info is None for r in schema.returns) and all(
        a.alias_info is None for a in schema.arguments)


def _keyed(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta" or type(value) is not torch.Tensor:
            raise _Unkeyable
        return ("tensor", tuple(value.shape), value.stride(), value.storage_offset(),
                value.dtype, value.untyped_storage().nbytes())
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_keyed(v) for v in value))
    if isinstance(value, _PLAIN):
        return (type(value), value)
    raise _Unkeyable


def _all_meta(value: Any) -> bool:
    """Whether ``value`` is a plain meta tensor, or a tuple / list of them (or of None)."""
    if isinstance(value, (list, tuple)):
        return all(_all_meta(v) for v in value)
    if value is None:
        return True
    return isinstance(value, torch.Tensor) and type(value) is torch.Tensor \
        and value.device.type == "meta"
