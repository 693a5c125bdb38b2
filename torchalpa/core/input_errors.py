"""Errors about what the user gave that carry their figures as fields, so that each front
words the remedy in its own terms: the Python API's messages name classes and keywords
(``ShardParallel()``), the command line's name its flags (``--method shard``,
``cli/commands.py``). The message ``str()`` gives is the Python API's."""

from __future__ import annotations

__all__ = ["BatchSplitError"]


class BatchSplitError(ValueError):
    """A batch input whose dim 0 (``batch``) the ``num_devices`` devices a method splits
    the batch over do not divide (data parallel, ZeRO, ``force_batch_dim_to_mesh_dim``)."""

    API_REMEDY = "use a batch that divides, or ShardParallel()"

    def __init__(self, value: str, batch: int, num_devices: int):
        self.value, self.batch, self.num_devices = value, batch, num_devices
        super().__init__(self.describe(self.API_REMEDY))

    def describe(self, remedy: str) -> str:
        """The refusal with ``remedy`` (what to do, in the caller's terms) after it."""
        return (f"{self.value}: the batch dim ({self.batch}) must divide by "
                f"{self.num_devices} devices to split the batch as asked (data parallel); "
                f"{remedy}")

    def __reduce__(self):       # pickled with its fields (ranks send errors to each other)
        return type(self), (self.value, self.batch, self.num_devices)
