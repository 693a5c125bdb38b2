"""What would fit a job no plan fits, from the views' memory floors (no solver run).

When every view of the devices refuses a step, the error says what would fit. The step's
memory bound (``passes/pricing/bounds.StepProfile.memory_bytes``) is cheap but loose: on
the tiny GPT fully checkpointed it let 2 devices through where no plan of 2 fits. The
views' memory floor (``intra_op.memory_floor``: every plan of a view holds at least it at
some point of its step, ``MemoryModel.lower_timeline``) is the one ``view_floor`` refuses
views by, so the advice reads it:

- memory: the least floor over the views tried -- a budget per device below it refuses
  every plan of these devices (a bound: at or above it a plan may still not fit);
- devices: the fewest devices, more than were tried, where some view's floor is within
  the budget, found by scanning counts upward from where the step's bound stops refusing.
  The counts scanned before it are refused by every view's floor (proved: no intra-op
  plan fits; pipelines are not covered); at the count found, the floor only lets plans
  through (not a proof one fits), so the advice says "at least". The scan is bounded by
  work, not by a clock, so the message is the same at any load: ``SCAN_WORK`` graph nodes
  times views (a floor is one pass over the step's liveness per view, about 0.3 CPU s on
  LLaMA-3-8B's 8,000 ops: some 30 views there, hundreds on a small model); past it the
  advice says how far it checked.

The hypothetical devices are views like the first one tried (its links, memory and
compute) with another count, 1D and every 2D factorization, as ``Cluster.candidate_shapes``
makes them, so ShardParallel's message and AutoParallel's agree for the same job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import ShardParallel
from torchalpa.core.units import format_bytes

__all__ = ["FitAdvice", "fit_advice", "least_floor", "views_of", "SCAN_WORK"]

SCAN_WORK = 250_000
"""Graph nodes times views whose floors the scan of device counts may compute."""
"""How long the device-count scan may take at most (its message says where it stopped)."""


@dataclass(frozen=True)
class FitAdvice:
    """What the floors say would fit one step (a checkpointing mode, a micro-batch)."""

    tried: int                 # the devices tried
    budget: float              # bytes per device the plans are held to
    memory: float              # the least floor over the views tried
    first_checked: int         # counts from ``tried + 1`` below it: refused by the bound
    devices: int | None        # fewest devices some view's floor lets through; None: none
    checked_to: int            # the last count the floors checked
    devices_floor: float = 0.0  # that count's least floor over its views
    kept: float = 0.0          # bytes of each device kept beside the budget (the offloaded
    #                            parameters' copies in flight): told as part of its memory
    unsplit: tuple[int, ...] = ()  # counts scanned none of whose views has a plan at all
    #                                (the batch does not split, a pin cannot hold)

    def devices_text(self) -> str:
        """``at least 4 devices of 387.0 KiB (...)``: the count, and how it was found."""
        below = self._refused_below()
        if self.devices is None:
            return (f"more than {self.checked_to} devices of {self._device()} "
                    f"({below}; larger counts not checked)")
        return (f"at least {self.devices} devices of {self._device()} ({below}; "
                f"on {self.devices}, their floor, {format_bytes(self.devices_floor)}, is "
                "within the budget: not a proof a plan fits)")

    def _refused_below(self) -> str:
        """Why the counts after the one tried and before the advice do not fit."""
        kept = f"{format_bytes(self.kept)} of each kept for the copies in flight; " \
            if self.kept else ""
        return kept + self._refused_counts()

    def _refused_counts(self) -> str:
        """The counts the step's bound refused, and those every view's floor did."""
        last = self.checked_to if self.devices is None else self.devices - 1
        by_bound = f"{self.tried + 1}-{self.first_checked - 1}" \
            if self.first_checked - 1 > self.tried + 1 else str(self.tried + 1)
        parts = []
        if self.first_checked > self.tried + 1:
            parts.append(f"{by_bound} refused by the step's memory bound")
        if last >= self.first_checked:
            counts = f"{self.first_checked}-{last}" if last > self.first_checked \
                else str(last)
            by = "every view's memory floor" if not self.unsplit else \
                f"every view (its memory floor; on {_listed(self.unsplit)}, the batch or the " \
                "method's pins do not split as asked)"
            parts.append(f"{counts} refused by {by}")
        return ", ".join(parts) or f"{self.tried} tried"

    def _device(self) -> str:
        """The memory of a device the advice's counts are of."""
        return format_bytes(self.budget + self.kept)

    def memory_text(self) -> str:
        """``2 devices with at least 387.3 KiB each (...)``: the memory per device."""
        kept = f", and {format_bytes(self.kept)} for the copies in flight" if self.kept else ""
        return (f"{self.tried} devices with at least {format_bytes(self.memory + self.kept)} "
                f"each (the views' least memory floor{kept}: a bound, not a proof a plan "
                "fits)")


def _listed(counts: tuple[int, ...]) -> str:
    return ", ".join(map(str, counts))


def views_of(mesh: LogicalMesh, count: int) -> list[LogicalMesh]:
    """Views of ``count`` devices like ``mesh``'s: 1D, and 2D for every factorization,
    each axis priced as ``mesh``'s first (the floors read shapes and bytes only)."""
    shapes: list[tuple[int, ...]] = [(count,)] + [
        (count // m, m) for m in range(2, count) if count % m == 0]
    return [replace(mesh, shape=shape, alpha=_first_axis(mesh.alpha, len(shape)),
                    beta=_first_axis(mesh.beta, len(shape)), axis_names=None)
            for shape in shapes]


def _first_axis(values: tuple[float, ...] | None, axes: int) -> tuple[float, ...] | None:
    """A mesh's per-axis prices for ``axes`` axes, each its first axis's."""
    return None if values is None else (values[0],) * axes


def least_floor(graph: OpGraph, meshes: list[LogicalMesh], method: ShardParallel, *,
                inputs: str = "global") -> tuple[float, float | None]:
    """(the least memory floor over ``meshes``, the budget the views' ILPs hold plans to;
    None: no budget)."""
    found = [_view_floor(graph, mesh, method, inputs) for mesh in meshes]
    budgets = [b for _, b in found if b is not None]
    return min(f for f, _ in found), (min(budgets) if budgets else None)


def _view_floor(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel,
                inputs: str) -> tuple[float, float | None]:
    """``memory_floor`` of one view; (inf, None) for a view that has no plan at all: its
    devices cannot split the batch as the method asks (``BatchSplitError``), or the
    method's pins and layout options cannot hold on it (``ViewConstraintError``: a weight
    pinned split where this count does not divide it)."""
    from torchalpa.core.input_errors import BatchSplitError
    from torchalpa.passes.sharding.constraints import ViewConstraintError
    from torchalpa.passes.sharding.intra_op import memory_floor
    try:
        return memory_floor(graph, mesh, method, inputs=inputs)
    except (BatchSplitError, ViewConstraintError):
        return math.inf, None


def fit_advice(graph: OpGraph, meshes: list[LogicalMesh], method: ShardParallel, *,
               inputs: str = "global", bound_devices: int = 1, scan: bool = True,
               kept: float = 0.0) -> FitAdvice | None:
    """The advice for ``graph`` planned by ``method`` on the views ``meshes`` (all of one
    device count), the scan starting where the step's bound (``bound_devices``, its
    ``devices_to_fit``) stops refusing (``scan=False``: no scan, the memory alone);
    ``kept``: ``FitAdvice.kept``. None where the views hold plans to no budget."""
    from torchalpa.passes.sharding.intra_op import FIT_TOLERANCE
    meshes = [m for m in meshes if m.num_devices == meshes[0].num_devices]
    memory, budget = least_floor(graph, meshes, method, inputs=inputs)
    if budget is None:
        return None
    tried = meshes[0].num_devices
    general = replace(method, logical_mesh_shape=None)
    first = count = max(tried + 1, bound_devices)
    if not scan:
        return FitAdvice(tried, budget, memory, first, None, tried, kept=kept)
    views_left, unsplit = max(1, SCAN_WORK // max(1, len(graph))), []
    while True:
        views = views_of(meshes[0], count)
        if len(views) > views_left and count > first:   # the first count is always checked
            return FitAdvice(tried, budget, memory, first, None, count - 1, kept=kept,
                             unsplit=tuple(unsplit))
        views_left -= len(views)
        floor, _ = least_floor(graph, views, general, inputs=inputs)
        if floor <= budget * (1 + FIT_TOLERANCE):
            return FitAdvice(tried, budget, memory, first, count, count, floor, kept,
                             tuple(unsplit))
        if math.isinf(floor):
            unsplit.append(count)
        count += 1
