"""The loss ``pmodel(x, y)`` returns while its all-reduce is still in flight.

A data-parallel step's loss is each rank's part, all-reduced. DDP has no such collective:
its loss is the rank's own. Waiting for it at the end of forward makes every rank wait for
the slowest one's forward before its backward starts, one more meeting point per step than
DDP's (whose ranks meet only where backward waits for its gradient buckets). So the
README's loop (``loss = pmodel(x, y); loss.backward(); opt.step()``) gets the loss as a
``PendingLoss``: a tensor of the loss's shape and dtype whose value is the all-reduced
loss, waited for on first read (``loss.item()``, ``print(loss)``, ``loss * 2``, any op),
or at the end of backward, whichever comes first. ``loss.backward()`` itself does not read
it: autograd seeds backward with ``ones_like(loss)``, which needs only its shape. The value
read is the same tensor the blocking forward returns, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_map

__all__ = ["PendingLoss", "LossBox"]


class LossBox:
    """The loss's value once waited for: ``finish()`` makes it, once."""

    __slots__ = ("_finish", "_value")

    def __init__(self, finish: Callable[[], torch.Tensor]):
        self._finish: Callable[[], torch.Tensor] | None = finish
        self._value: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        if self._finish is not None:
            self._value, self._finish = self._finish(), None
        assert self._value is not None
        return self._value


# ops that read only the shape and dtype of their tensor argument
_SHAPE_ONLY = {torch.ops.aten.ones_like.default, torch.ops.aten.zeros_like.default,
               torch.ops.aten.empty_like.default}


class PendingLoss(torch.Tensor):
    """A loss whose all-reduce is in flight: any op on it waits for the value first and
    runs on that (a plain tensor comes out), except ``ones_like`` and the like."""

    _box: LossBox

    @staticmethod
    def __new__(cls, box: LossBox, like: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(  # pyright: ignore[reportAttributeAccessIssue]
            cls, like.shape, dtype=like.dtype, device=like.device)
        out._box = box
        return out

    def __repr__(self, *, tensor_contents=None) -> str:  # pyright: ignore[reportIncompatibleMethodOverride]
        del tensor_contents
        return repr(self._box.value())

    def __format__(self, spec: str) -> str:
        return format(self._box.value(), spec)

    def __reduce_ex__(self, protocol):
        return self._box.value().__reduce_ex__(protocol)

    def tolist(self):  # pyright: ignore[reportIncompatibleMethodOverride]
        return self._box.value().tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        del types
        if func in _SHAPE_ONLY:
            def read(t):
                return torch.empty(t.shape, dtype=t.dtype, device=t.device) \
                    if isinstance(t, PendingLoss) else t
        else:
            def read(t):
                return t._box.value() if isinstance(t, PendingLoss) else t
        return func(*tree_map(read, args), **tree_map(read, kwargs or {}))
