"""The experts' data-parallel layout, weighed beside AutoParallel's intra-op plans.

The intra-op ILP picks each view's plan by its objective; views and candidates are then
compared by the step's estimate, which prices what the objective does not (the overlap of
communication with compute, above all). So a layout the objective does not prefer may
estimate lower, and the layout published runs use -- the batch split over every device,
each parameter sharded over them as ZeRO / FSDP place it (gathered in forward; with FSDP's
reshard after forward, again in backward) -- can beat the free ILP's plan by the estimate
(MPT-125M on 8 A100: 1.0706 s against 1.0713 s). This module says what that layout is for a
candidate: the same restriction ``benchmarks/published.py`` pins a published FSDP run with
(one mesh axis over every device, the batch's dim 0 on it, parameters sharded), solved as
a restricted ILP on that one view, which is cheap next to the free search.

AutoParallel (``parallel/auto.py``) weighs it where it could win: on one node, for the
intra-op candidates planned whose bounds let a plan of theirs beat the best plan in hand
(``_Search.weigh_layouts``; the free plan's estimate is no guide: near the memory budget
the layout estimated 5.5 % below it on MPT-13B on 8 A100 40GB, 67.81 s against 71.76 s);
on several nodes, where intra-op candidates give way to pipelines, as candidates of their
own kind (``KIND``), so a multi-node FSDP run's plan is in the search; there its step
is bounded by its gradients' reductions too (``gradient_floor_s``), which cross the nodes'
links whatever the ILP does, so that it is not solved where it cannot win. The plan keeps a
note (``NOTE``) when the layout won.
"""

from __future__ import annotations

from dataclasses import replace

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import AutoShardingOption
from torchalpa.core.plan import Plan
from torchalpa.core.plan_records import known

__all__ = ["KIND", "NOTE", "view", "applies", "option", "divides", "describe",
           "better", "gradient_floor_s"]

KIND = "data-parallel"
"""The candidate kind of the layout alone (AutoParallel on several nodes)."""

NOTE = "the data-parallel layout won: "
"""How the note begins that says the layout, not the free ILP's plan, was kept."""


def view(meshes: list[LogicalMesh]) -> LogicalMesh | None:
    """The one-axis view over every device among ``meshes`` (None where there is none)."""
    return next((m for m in meshes if len(m.shape) == 1 and
                 m.shape[0] == max(x.num_devices for x in meshes)), None)


def applies(given: AutoShardingOption, mesh: LogicalMesh | None) -> bool:
    """Whether the layout is one the user's options leave open: more than one device, the
    batch, the parameters and their pins left to the planner, the ILP searching, and
    all-gathers allowed (sharded parameters are gathered where they are read)."""
    return mesh is not None and mesh.num_devices > 1 and given.enable_auto_sharding and \
        not given.force_data_parallel and given.force_batch_dim_to_mesh_dim is None and \
        given.parameters == "auto" and not given.pin and given.allow_all_gather and \
        not given.force_simple_heuristic


def option(given: AutoShardingOption) -> AutoShardingOption:
    """``given`` restricted to the layout: the batch on the mesh's one axis, parameters
    sharded over it (``given``'s ``rematerialize_parameters`` says whether FSDP's gather
    again in backward); the rest of ``given`` as it is."""
    return replace(given, force_batch_dim_to_mesh_dim=0, parameters="sharded")


def divides(batch: int, num_micro_batches: int, mesh: LogicalMesh) -> bool:
    """Whether each micro-batch splits evenly over the view's devices."""
    return (batch // num_micro_batches) % mesh.num_devices == 0


def describe(mesh: LogicalMesh, regather: bool) -> str:
    """The layout in words, for the notes."""
    how = "FSDP's, gathered again in backward" if regather else \
        "ZeRO's, gathered once in forward"
    return (f"batch split over all {mesh.num_devices} devices, parameters sharded over them "
            f"({how})")


def better(free: Plan, layout: Plan, mesh: LogicalMesh, regather: bool) -> Plan:
    """Whichever of the free ILP's plan and the layout's the step estimate prices lower
    (the free one on a tie); the layout's with a note saying so."""
    free_s, layout_s = known(free.estimates.step_time_s), known(layout.estimates.step_time_s)
    if layout_s >= free_s:
        return free
    return replace(layout, notes=tuple(layout.notes) + (
        f"{NOTE}{describe(mesh, regather)}: est {layout_s:.6g} s/step, the free ILP's plan "
        f"{free_s:.6g} s/step",))


def gradient_floor_s(graph: OpGraph, mesh: LogicalMesh) -> float:
    """Seconds the layout's plans on ``mesh`` (its one axis over every device) take at
    least: with the batch split over every device, each trained parameter's gradient is
    a partial sum over all of them, reduced at least by a reduce-scatter on that axis,
    and the step ends when the communication stream has done them all (overlap hides
    them behind compute, never shortens them). Each reduction counted in the narrowest
    floating dtype the step computes in (a gradient may be reduced in 16 bits before its
    cast up to the master parameter's dtype), without its latency (buckets share it).
    A floor under that premise, checked against the layout's plans, not proven: a
    parameter whose gradient the ILP makes whole on every device (an embedding split by
    rows whose ids are gathered) would need no reduction. Where it errs the search only
    misses this layout's plan, which main's search did not weigh at all."""
    from torchalpa.passes.pricing.cost import collective_cost
    from torchalpa.passes.pricing.step_end import trained_parameters
    floats = [v.itemsize for n in graph for v in n.outputs if "float" in v.dtype]
    narrowest = min(floats, default=4)
    flat = replace(mesh, alpha=(0.0,))
    return sum(collective_cost(flat, "reduce_scatter", 0,
                               graph.node(name).output.numel * min(
                                   graph.node(name).output.itemsize, narrowest))
               for name in trained_parameters(graph))
