"""A whole graph's intra-op ILP on one logical view refused by its memory floor, before it
is built.

``plan_intra_op`` returns a plan only where its timeline's peak is within the memory
budget; ``intra_op.memory_floor`` is what every such plan holds at some point of its step
(``MemoryModel.lower_timeline``: model states and activations each at their smallest
layout). Where the floor is above the budget, every ILP the view would solve -- the
simplified one, the one with free followers, its least-memory ILPs for the error's message
-- ends without a plan, so the view is answered "does not fit" from one pass over the
step's liveness: on LLaMA-3-8B, remat full:2 at 2 micro-batches on 8 H100 (target a), 0.3
CPU s a view where its ILPs took 15 or more. The pipeline search's stages have had the
same proof since ``stage_solve.cannot_fit``; this is the whole graph's (``plan_graph``:
ShardParallel, AutoParallel's intra-op candidates and data-parallel layouts).
``PassSwitches.view_floor`` turns it off.
"""

from __future__ import annotations

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import ShardParallel
from torchalpa.core.switches import PassSwitches
from torchalpa.core.units import format_bytes
from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
from torchalpa.passes.sharding.ilp import OverMemoryBudget
from torchalpa.passes.sharding.intra_op import FIT_TOLERANCE, memory_floor

__all__ = ["FloorRefusal", "floor_refusal"]


class FloorRefusal(OverMemoryBudget):
    """A view whose memory floor is above its budget: no plan of its ILP fits, proved
    without one. Its message only (a plain error's arguments): it may cross from a forked
    worker to the searching process."""


def floor_refusal(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel, *,
                  inputs: str = "global", memo: PricingMemo | None = None
                  ) -> FloorRefusal | None:
    """The refusal of ``plan_intra_op(graph, mesh, method, inputs=inputs)`` (any
    ``blocks``, start or values read twice: none changes which plans fit) where its memory
    floor is above its budget (``FIT_TOLERANCE``); None where it is not, where there is no
    budget, or where ``PassSwitches.view_floor`` is off. ``memo``: ``plan_intra_op``'s
    (the strategies it prices are the ILP's own)."""
    if not PassSwitches.current().view_floor:
        return None
    floor, budget = memory_floor(graph, mesh, method, inputs=inputs, memo=memo)
    if budget is None or floor <= budget * (1 + FIT_TOLERANCE):
        return None
    view = f"1D mesh of {mesh.num_devices} devices" if len(mesh.shape) == 1 else \
        f"mesh of {'x'.join(map(str, mesh.shape))}"
    return FloorRefusal(
        f"the model does not fit in {format_bytes(budget)} per device on a {view}: every "
        f"plan holds at least {format_bytes(floor)} per device at some point of its step "
        "(its memory floor: parameters, gradients, optimizer states and activations each at "
        "their smallest layout; no solver run); use more devices, a smaller batch, or a "
        "larger memory_budget_per_device")
