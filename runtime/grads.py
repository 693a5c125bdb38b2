"""Hand a step's local gradients to their DTensor parameters, cheaply.

``DTensor.from_local`` is an autograd Function that builds a new layout spec each call:
some tens of microseconds per parameter, paid for every gradient of every step. A
gradient has its parameter's layout (mesh, placements, global shape and stride, dtype),
so it can share the parameter's spec and be wrapped directly; ``from_local`` remains for
a gradient whose dtype or local shape differs from its parameter's (then the spec does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

__all__ = ["attach_gradients"]


def attach_gradients(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                     *, clear_missing: bool = False) -> None:
    """Set ``p.grad`` for each parameter with a gradient (its local block, in the
    parameter's layout); a None gradient leaves ``p.grad`` as it is, or sets it to None
    with ``clear_missing``."""
    for p, g in zip(params, grads):
        if g is None:
            if clear_missing:
                p.grad = None
            continue
        if not isinstance(p, DTensor):
            p.grad = g
        elif g.dtype == p.dtype and g.shape == p._local_tensor.shape:
            p.grad = DTensor(g, p._spec, requires_grad=False)  # pyright: ignore[reportCallIssue]
        else:
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
