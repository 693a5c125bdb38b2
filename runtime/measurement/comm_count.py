"""Count the collectives a program actually issues, at the dispatcher.

``CollectiveCounter`` is a TorchDispatchMode that records every functional collective
that runs under it (kind, mesh axis, bytes this rank contributes), whatever code issued
it. Tests compare the record of one real step with the plan's ``collectives``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveCounter", "CollectiveRecord"]

_c10d = torch.ops._c10d_functional
_KINDS = {
    _c10d.all_reduce.default: "all_reduce",
    _c10d.all_reduce_.default: "all_reduce",
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_to_all_single.default: "all_to_all",
}
_GROUP_ARG = {"all_reduce": 2, "all_gather": 2, "reduce_scatter": 3, "all_to_all": 3}


@dataclass(frozen=True)
class CollectiveRecord:
    kind: str
    axis: int | None
    bytes: int


class CollectiveCounter(TorchDispatchMode):
    """Records functional collectives; ``group_axes`` maps process-group names to mesh axes."""

    def __init__(self, group_axes: dict[str, int] | None = None):
        super().__init__()
        self.group_axes = dict(group_axes or {})
        self.records: list[CollectiveRecord] = []

    @classmethod
    def for_mesh(cls, mesh) -> CollectiveCounter:
        return cls({mesh.get_group(i).group_name: i for i in range(mesh.ndim)})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = _KINDS.get(func)
        if kind is not None:
            tensor = args[0]
            group = args[_GROUP_ARG[kind]] if len(args) > _GROUP_ARG[kind] else None
            axis = None if group is None else self.group_axes.get(group)
            self.records.append(CollectiveRecord(kind, axis, tensor.nbytes))
        return func(*args, **(kwargs or {}))

    def counts(self) -> Counter:
        return Counter((r.kind, r.axis, r.bytes) for r in self.records)
