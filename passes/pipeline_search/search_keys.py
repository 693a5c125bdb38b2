"""The pipeline search's records: what a stage candidate is, how it is planned, and the
key of a stage plan the search made. Named tuples: hashable dictionary keys that read by
field (``key.in_flight``), and still unpack where a loop takes every field."""

from __future__ import annotations

from typing import NamedTuple

from torchalpa.core.cluster import Submesh, View
from torchalpa.core.options import AutoShardingOption

__all__ = ["Candidate", "Chosen", "GivenStage", "PlanKey", "Stage", "Variant"]


class Variant(NamedTuple):
    """How a stage is planned: its logical view, lean (sharded states), recomputed."""
    view: View
    lean: bool
    recompute: bool


class Candidate(NamedTuple):
    """A stage variant with what the per-layer sums say it costs."""
    latency: float
    memory: float           # additive memory per device
    view: View
    lean: bool
    recompute: bool

    @property
    def variant(self) -> Variant:
        return Variant(self.view, self.lean, self.recompute)


class Stage(NamedTuple):
    """A stage to price exactly."""
    first: int
    last: int
    submesh: Submesh
    view: View
    in_flight: int
    recompute: bool


class PlanKey(NamedTuple):
    """A stage plan the search made."""
    first: int
    last: int
    submesh: Submesh
    view: View
    lean: bool
    in_flight: int
    recompute: bool


class Chosen(NamedTuple):
    """How a stage of the answer is planned; ``option`` None for the method's own."""
    view: View
    option: AutoShardingOption | None
    recompute: bool


class GivenStage(NamedTuple):
    """A stage of a uniform partition the search priced exactly."""
    layers: tuple[int, int]     # first and last layer (inclusive)
    submesh: Submesh
    view: View
    option: AutoShardingOption | None
    recompute: bool

    @property
    def layout(self) -> tuple:
        """((first, last), submesh, view, option): what ``assemble_pipeline`` takes."""
        return self.layers, self.submesh, self.view, self.option
