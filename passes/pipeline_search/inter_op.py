"""The inter-op pass (Alpa's PipeshardParallel): layers -> stages on submeshes -> plans.

``plan_pipeline`` reads as the steps it takes, each in a module of its own:

1. Layers (``passes/pipeline_search/layers.py::assign_layers``): the model's pipeline-boundary markers, or
   Alpa's layer construction.
2. Stages: given by the method (``passes/pipeline_search/given_stages.py``: by hand, or uniform), or
   searched: every distinct layer priced on every searched view of every submesh
   (``passes/pipeline_search/layer_costs.py``, ``passes/pipeline_search/submesh_views.py``), then Alpa's stage DP on the
   ranges' additive estimates (``passes/pipeline_search/stage_costs.py``) in rounds that price the stages
   it picks by their own memory-constrained ILP (``passes/pipeline_search/stage_search.py``,
   ``passes/pipeline_search/exact_stages.py``), the solves in forked workers (``passes/pipeline_search/stage_jobs.py``)
   and cached by structure in a ``SolveCache`` the search owns, or is given to share
   across searches (``passes/pipeline_search/layer_cache.py``); the pricing work its intra-op solves
   repeat is kept in a ``PricingMemo`` the search owns (``passes/pipeline_search/pricing_memo.py``).
3. Each chosen stage's own graph planned exactly on its submesh, and the stages, their
   transfers and an estimated timeline form the PipelinePlan
   (``passes/pipeline_search/pipeline_assembly.py``).

With ``stage_option="profile"`` the DP uses layer times measured on the devices instead of
the cost model's: ``layer_probes`` gives, for every distinct layer on every submesh view,
an executable one-layer stage to time (the runtime times it), and
``plan_pipeline(measured=...)`` takes the results.

The graph must be captured for one micro-batch.

Each phase (layer ILPs, stage DP with exact stage solves, the stages' own plans) is a
``core.progress.step``: a line when it starts and ends (shown by default,
``TORCHALPA_LOG``), and while it runs a line every ``HEARTBEAT_S`` with what is left of it
(the worker pools count their results, ``stage_jobs``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from torchalpa.core.cluster import Cluster
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import ManualStageOption, PipeshardParallel, UniformStageOption
from torchalpa.core.plan import PipelinePlan
from torchalpa.core.progress import step
from torchalpa.passes.pipeline_search.exact_stages import ExactStages
from torchalpa.passes.pipeline_search.given_stages import manual_stages, uniform_stages
from torchalpa.passes.pipeline_search.layer_bound import CannotBeat, search_floor_s
from torchalpa.passes.pipeline_search.layer_cache import SolveCache, layer_signatures
from torchalpa.passes.pipeline_search.layer_costs import LayerCosts, micro_batch_seconds
from torchalpa.passes.pipeline_search.layers import assign_layers
from torchalpa.passes.pipeline_search.pipeline_assembly import assemble_pipeline, fastest_of
from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
from torchalpa.passes.pipeline_search.search_keys import GivenStage
from torchalpa.passes.pipeline_search.search_problem import SearchProblem
from torchalpa.passes.pipeline_search.stage_costs import StageCosts
from torchalpa.passes.pipeline_search.stage_jobs import cpu_workers
from torchalpa.passes.pipeline_search.stage_search import StageSearch
from torchalpa.passes.pipeline_search.stages import submesh_shapes
from torchalpa.passes.pipeline_search.submesh_views import (
    logical_views,
    searched_views,
    shardable_views,
    tensor_dims,
    view_notes,
)
from torchalpa.passes.sharding.ilp import CLOCK_NOTE, InfeasibleError, clock_watch

__all__ = ["plan_pipeline", "assign_layers", "logical_views", "shardable_views",
           "searched_views", "layer_probes", "LayerProbe", "micro_batch_seconds"]

log = logging.getLogger("torchalpa.planner")


def plan_pipeline(graph: OpGraph, cluster: Cluster, method: PipeshardParallel, *,
                  inputs: str = "global", measured: dict | None = None,
                  share_views: bool = True, solves: SolveCache | None = None,
                  pricing: PricingMemo | None = None,
                  workers: int | None = None,
                  refuse_above: float | None = None) -> PipelinePlan:
    """Alpa's PipeshardParallel plan of ``graph`` (one micro-batch) on ``cluster``.

    ``measured``: seconds per micro-batch of each ``LayerProbe.key`` timed on the devices
    (required by ``stage_option="profile"``, which otherwise plans like "auto").
    ``share_views``: views of one class share a layer's solve, and dominated views are
    skipped (``LayerCosts.prefetch``, ``searched_views``); off, every shardable view is
    solved (slow: the reference the sharing is tested against). ``solves``: the cache of
    layer and stage solves (default: a new one; pass one to several searches to reuse
    what repeats exactly). ``pricing``: the pricing work its intra-op solves repeat
    (default: a new ``PricingMemo``; pass one to several searches on the same cluster,
    e.g. the remat captures, to price each resharding once). ``workers``: processes for
    independent solves (default: one per core this process may use). ``refuse_above``: a
    step time (seconds) the search need not beat (the best plan its caller holds): a
    searched pipeline whose layers' own plans bound it at or above that stops after its
    layer ILPs, before any stage ILP (``CannotBeat``, ``layer_bound.py``)."""
    start = time.perf_counter()
    if method.stage_option == "profile" and measured is None:
        raise ValueError("stage_option='profile' times layers on this job's devices: call "
                         "torchalpa.auto_parallel under torchrun (torchalpa.plan has no "
                         "devices to time on), or use stage_option='auto'")
    problem = SearchProblem(graph, assign_layers(graph, method, cluster.num_devices), cluster,
                            method, inputs)
    cache = SolveCache() if solves is None else solves
    workers = cpu_workers() if workers is None else workers
    layers = LayerCosts(problem, cache, PricingMemo() if pricing is None else pricing,
                        measured, share_views)
    costs = StageCosts(problem, layers)
    exact = ExactStages(problem, costs, cache)
    with clock_watch() as stops:     # forked workers' stops too (``stage_jobs``)
        chosen = _choose_stages(costs, exact, workers, start, refuse_above)
        searched = time.perf_counter()
        with step(f"pipeline of {len(chosen.stages)} stages, {method.num_micro_batches} "
                  "micro-batches: the stages' own plans") as phase:
            plan = _assemble(problem, chosen, layers, exact, workers)
            phase.done = f"est {plan.estimates.step_time_s:.4g} s/step"
    if stops:
        chosen.notes.append(
            f"{CLOCK_NOTE} {len(stops)} of the pipeline search's solver runs (at "
            f"{max(stops):.0f} s): a faster or idler machine may find a better plan; "
            "not cached")
    log.info("pipeline plan: %d layers, %d stages, %d layer solves for the DP (%.1fs), "
             "stage plans %.1fs (%d moved from identical layers, %d exact solves answered "
             "from fewer in flight, %d proved not to fit without a sharded-states solve, "
             "%d by their memory floor without an ILP)",
             problem.num_layers, len(chosen.stages), layers.solves, searched - start,
             time.perf_counter() - searched, exact.transplanted, exact.reused_in_flight,
             exact.proved_unfit, exact.floored)
    return replace(plan, notes=plan.notes + tuple(chosen.notes),
                   estimates=replace(
                       plan.estimates, search_seconds=searched - start,
                       layer_solves=layers.solves, layers_repriced=layers.repriced,
                       stage_solves=exact.exact_solves,
                       total_seconds=time.perf_counter() - start))


@dataclass
class _Choice:
    """The stages a pipeline is made of ((first, last), submesh, view, option), whether
    each is recomputed (None: none), the uniform partitions the search priced exactly
    (alternatives for the assembly), and notes for the plan."""

    stages: list
    recompute: list[bool] | None = None
    uniform: list[list[GivenStage]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _choose_stages(costs: StageCosts, exact: ExactStages, workers: int,
                   start: float, refuse_above: float | None = None) -> _Choice:
    """The stages the method gives (by hand, uniform), or the search's."""
    problem = costs.problem
    method, cluster, L = problem.method, problem.cluster, problem.num_layers
    option = method.stage_option
    if isinstance(option, ManualStageOption):
        return _Choice(manual_stages(option, L, cluster),
                       list(option.recompute) if option.recompute else None)
    if isinstance(option, UniformStageOption):
        return _Choice(*uniform_stages(option, L, cluster, costs, method.num_micro_batches,
                                       method.pipeline_schedule))
    return _search(costs, exact, workers, start, refuse_above)


def _search(costs: StageCosts, exact: ExactStages, workers: int, start: float,
            refuse_above: float | None = None) -> _Choice:
    """Every distinct layer priced on every searched view, then the stage search (unless
    the layers' plans bound the pipeline at ``refuse_above`` or more: ``CannotBeat``)."""
    problem, layers = costs.problem, costs.layers
    method, cluster, L = problem.method, problem.cluster, problem.num_layers
    B, schedule = method.num_micro_batches, method.pipeline_schedule
    shapes = submesh_shapes(cluster.num_nodes, cluster.devices_per_node)
    views = sum(len(layers.views(shape)) for shape in shapes)
    with step(f"pipeline search, {B} micro-batches: layer ILPs of {L} layers "
              f"({len(set(problem.signature))} distinct) on {views} views of {len(shapes)} "
              "submeshes") as phase:
        layers.prefetch(shapes, workers=workers,
                        max_in_flight=min(B, L) if schedule == "1f1b" else B)
        phase.done = (f"{layers.solves} layer ILPs, {layers.repriced} more views priced with "
                      f"their class's plan, {layers.copied} given a view's that replicates "
                      "alike")
    log.info("pipeline search: %d layer solves, %d more views priced with their "
             "class's plan, in %.1fs", layers.solves, layers.repriced,
             time.perf_counter() - start)
    if layers.measured is None:
        bound = search_floor_s(costs)
        log.info("pipeline search, %d micro-batches: its layers' own plans bound it at "
                 "%.6g s/step%s", B, bound, "" if refuse_above is None else
                 f" (to beat: {refuse_above:.6g} s/step)")
        if refuse_above is not None and bound >= refuse_above:
            raise CannotBeat(bound, refuse_above)
    with step(f"pipeline search, {B} micro-batches: stage DP and exact stage solves"
              ) as phase:
        try:
            found = StageSearch(costs, exact, cluster, B, schedule, shapes, workers).run()
        except ValueError as e:    # no stage fits: infeasible, like an ILP that finds none
            raise InfeasibleError(f"pipeline search on {cluster.num_nodes}x"
                                  f"{cluster.devices_per_node} devices with {B} micro-batches:"
                                  f" {e}") from e
        phase.done = (f"{len(found.solution.stages)} stages chosen, {found.num_priced} stage "
                      f"variants priced exactly ({exact.exact_solves} stage ILPs, "
                      f"{exact.floored} refused by their memory floor)")
    log.info("pipeline search: %d stage candidates priced exactly (%d stage solves, %d stages "
             "refused by their memory floor)", found.num_priced, exact.exact_solves,
             exact.floored)
    stages = [(s.layers, s.submesh, chosen.view, chosen.option)
              for s, chosen in zip(found.solution.stages, found.stages)]
    notes = view_notes(shapes, problem.dims, layers.share_views and
                       method.auto_sharding_option.allow_mixed_mesh_shape)
    return _Choice(stages, [chosen.recompute for chosen in found.stages], found.uniform, notes)


def _assemble(problem: SearchProblem, chosen: _Choice, layers: LayerCosts,
              exact: ExactStages, workers: int) -> PipelinePlan:
    """The chosen stages' plan (stage times measured where every layer was timed), or a
    uniform partition's the search priced exactly, where its timeline is shorter."""

    def assemble(stages: list, recompute: list[bool] | None,
                 stage_seconds: list | None = None) -> PipelinePlan:
        return assemble_pipeline(problem.graph, problem.layer, stages, problem.cluster,
                                 problem.method, problem.inputs, stage_seconds=stage_seconds,
                                 known=exact.exact_plans, recompute=recompute,
                                 donor=exact.donated, workers=workers, memo=layers.memo)

    timed = [layers.range_seconds(k, i, view, submesh)
             for (k, i), submesh, view, _ in chosen.stages]
    plan = assemble(chosen.stages, chosen.recompute,
                    timed if all(t is not None for t in timed) else None)
    return fastest_of(plan, chosen.uniform, lambda alternative: assemble(
        [st.layout for st in alternative], [st.recompute for st in alternative]))


@dataclass(frozen=True)
class LayerProbe:
    """One distinct layer on one submesh view, as an executable stage to time: stage
    ``stage`` of ``plan`` runs exactly that layer on a mesh of shape ``view``."""

    key: tuple          # (layer signature, view, submesh): what ``measured`` is keyed by
    layer: int          # a layer with that signature
    plan: PipelinePlan
    stage: int


def layer_probes(graph: OpGraph, cluster: Cluster, method: PipeshardParallel, *,
                 inputs: str = "global") -> list[LayerProbe]:
    """What ``stage_option="profile"`` times: every distinct layer on every view of every
    submesh the DP considers, each as the middle stage of a plan whose other layers sit on
    single devices of a cluster large enough to hold them (those stages never run)."""
    layer = assign_layers(graph, method, cluster.num_devices)
    L = max(layer.values()) + 1
    signature = layer_signatures(graph, layer, L)
    probes, seen = [], set()
    dims = tensor_dims(graph)
    room = replace(cluster, num_nodes=cluster.num_nodes + 2)
    for submesh in submesh_shapes(cluster.num_nodes, cluster.devices_per_node):
        for view in shardable_views(submesh, dims):
            for l in range(L):
                key = (signature[l], view, submesh)
                if key in seen:
                    continue
                seen.add(key)
                stages = ([((0, l - 1), (1, 1), (1,), None)] if l > 0 else []) + \
                    [((l, l), submesh, view, None)] + \
                    ([((l + 1, L - 1), (1, 1), (1,), None)] if l < L - 1 else [])
                plan = assemble_pipeline(graph, layer, stages, room, method, inputs)
                probes.append(LayerProbe(key, l, plan, 1 if l > 0 else 0))
    return probes
