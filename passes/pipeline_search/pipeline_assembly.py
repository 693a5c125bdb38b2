"""A pipeline's plan from its stages: each stage planned exactly, placed, timed by its schedule.

Given the stages ((first, last layer), submesh, view, option), ``assemble_pipeline``
plans each stage's own graph on its submesh (reusing the plans the search made, or moving
one made for identical layers elsewhere), places the submeshes on the cluster's ranks, lists
what crosses between stages (``passes/pipeline_search/stage_transfers.py``) and estimates the step by
simulating the schedule (``pipeline_estimates``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

from torchalpa.core.cluster import Cluster
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import PipeshardParallel
from torchalpa.core.plan import PipelinePlan, Plan, StagePlan, Transfer
from torchalpa.core.plan_records import Estimates, known
from torchalpa.core.schedules import SCHEDULES, in_flight, simulate
from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
from torchalpa.passes.pipeline_search.search_keys import GivenStage, PlanKey
from torchalpa.passes.pipeline_search.stage_jobs import cpu_workers, fork_map
from torchalpa.passes.pipeline_search.stage_recompute import (
    FORWARD_SHARE,
    received_bytes,
    recompute_memory,
    recompute_seconds,
)
from torchalpa.passes.pipeline_search.stage_solve import (
    StageRequest,
    plan_stage,
    polished,
    polishes,
    stage_request,
    stage_seconds,
)
from torchalpa.passes.pipeline_search.stage_transfers import (
    batch_splits,
    scatter_gather,
    stage_transfers,
    transfer_seconds,
)
from torchalpa.passes.pipeline_search.subgraph import stage_subgraph
from torchalpa.passes.pipeline_search.submesh_views import submesh_cluster
from torchalpa.passes.pricing.memory import in_flight_bytes
from torchalpa.passes.sharding.ilp import InfeasibleError

__all__ = ["assemble_pipeline", "place_submeshes", "pipeline_estimates", "fastest_of",
           "POLISH_SPAN"]

POLISH_SPAN = 0.05
"""A stage the search planned is polished (``stage_solve.polished``) only where its
seconds per micro-batch are within this share of the slowest stage's: the stages that
are, or could become once the slowest is polished, the pipeline's bottleneck, which a
step of B micro-batches pays about B times; any other stage's seconds count about once
(its warm-up and cool-down). On target b (LLaMA-2-13B, 200 micro-batches, 15 stages)
the unsimplified re-solve bettered a stage by at most 2.2 %, and polishing all 13 stages
small enough took over 500 s (load 13-24)."""

log = logging.getLogger("torchalpa.planner")

Donor = Callable[..., Plan | None]
"""``ExactStages.donated``: a plan moved from identical layers, or None."""


def assemble_pipeline(graph: OpGraph, layer: dict[str, int], stages: list, cluster: Cluster,
                      method: PipeshardParallel, inputs: str,
                      stage_seconds: list | None = None, known: dict | None = None,
                      recompute: list[bool] | None = None, donor: Donor | None = None,
                      workers: int | None = None, memo: PricingMemo | None = None
                      ) -> PipelinePlan:
    """The PipelinePlan of ``stages`` ((first, last layer), submesh, view, option), each
    stage planned exactly; ``known`` holds stage plans the search already solved, keyed
    (first, last, submesh, view, lean, in flight, recompute), reused when made for the
    same graph. ``recompute``: per stage, whether it checkpoints its activations (planned
    with one micro-batch in flight in what the others' inputs leave of the budget).
    ``stage_seconds``: measured seconds per stage, in place of the plans' estimates.
    ``workers``: processes for the stages left to solve (default: one per core).
    ``memo``: pricing work kept across solves (``passes/pipeline_search/pricing_memo.py``)."""
    recompute = list(recompute) if recompute else [False] * len(stages)
    stage_of_layer = {l: s for s, ((k, i), _, _, _) in enumerate(stages)
                      for l in range(k, i + 1)}
    node_stage = {n: stage_of_layer[l] for n, l in layer.items()}
    ranks = place_submeshes([st[1] for st in stages], cluster)
    subs = [stage_subgraph(graph, node_stage, s) for s in range(len(stages))]
    # each stage must fit with the micro-batches its schedule keeps in flight, as the DP
    # and the estimates count them
    schedule = SCHEDULES[method.pipeline_schedule](len(stages), method.num_micro_batches)
    flights = [in_flight(schedule[s]) for s in range(len(stages))]
    received = [received_bytes(graph, lambda name, s=s: node_stage[name] == s)
                if recompute[s] else 0.0 for s in range(len(stages))]
    meshes = [submesh_cluster(cluster, submesh).logical_mesh(view)
              for _, submesh, view, _ in stages]
    # what crosses batch-split, agreed by both stages before either is solved
    transfers = batch_splits(graph, stage_transfers(graph, node_stage, subs), subs, meshes)
    requests = [stage_request(sub.graph, meshes[s], method, option, inputs, flights[s],
                              received[s] if recompute[s] else None)
                for s, (sub, (_, _, _, option)) in enumerate(zip(subs, stages))]
    plans, notes = _stage_plans(stages, requests, flights, recompute, known or {}, donor,
                                cpu_workers() if workers is None else workers,
                                PricingMemo() if memo is None else memo)
    stage_plans = [StagePlan(index=s, layers=tuple(range(k, i + 1)), submesh=submesh,
                             ranks=ranks[s], plan=plans[s], recompute=recompute[s])
                   for s, ((k, i), submesh, _view, _option) in enumerate(stages)]
    transfers = scatter_gather(graph, transfers, meshes, _stage_link(cluster))
    return PipelinePlan(mesh_shape=(cluster.num_nodes, cluster.devices_per_node),
                        stages=tuple(stage_plans), transfers=tuple(transfers),
                        node_stage=node_stage, num_micro_batches=method.num_micro_batches,
                        schedule=method.pipeline_schedule,
                        estimates=pipeline_estimates(stage_plans, transfers, method, cluster,
                                                     stage_seconds, received),
                        method=method.to_dict(), graph_fingerprint=graph.fingerprint(),
                        notes=tuple(notes))


def _stage_link(cluster: Cluster) -> float:
    """Bytes per second a value crosses between two stages with."""
    return cluster.inter_node_bandwidth if cluster.num_nodes > 1 else \
        cluster.intra_node_bandwidth


def _stage_plans(stages: list, requests: list[StageRequest], flights: list[int],
                 recompute: list[bool], known: dict, donor: Donor | None,
                 workers: int, memo: PricingMemo) -> tuple[list[Plan], list[str]]:
    """Each stage's plan, and a note on those polished: the search's own where it made
    one for this very stage graph, else one moved from identical layers (``donor``), else
    solved now (``workers`` at a time). A stage given an option other than the
    sharded-states one is always solved. A plan of the search's is polished
    (``stage_solve.polished``: re-solved unsimplified where the graph is small enough,
    the better plan kept) where it is within ``POLISH_SPAN`` of the slowest stage, the
    search having solved none so."""
    plans: list[Plan | None] = [None] * len(stages)
    for s, ((k, i), submesh, view, option) in enumerate(stages):
        lean = option is not None and option.parameters == "sharded"
        if option is not None and not lean:
            continue
        plan = known.get(PlanKey(k, i, submesh, view, lean, flights[s], recompute[s]))
        if plan is not None and plan.graph_fingerprint == requests[s].graph.fingerprint():
            plans[s] = plan
        elif donor is not None:
            plans[s] = donor(k, i, submesh, view, lean, flights[s], recompute[s], requests[s])
    todo = [s for s in range(len(stages)) if plans[s] is None]
    searched = [s for s in range(len(stages)) if plans[s] is not None]
    solve = functools.partial(plan_stage, memo=memo)
    for s, plan in zip(todo, fork_map(solve, [requests[s] for s in todo], workers)):
        plans[s] = plan
    solved = [plan for plan in plans if plan is not None]
    assert len(solved) == len(stages), "a stage was left without a plan"
    latency = [recompute_seconds(stage_seconds(p, r)) if again else stage_seconds(p, r)
               for p, r, again in zip(solved, requests, recompute)]
    slowest = max(latency)
    rough = [s for s in searched if polishes(requests[s])
             and latency[s] >= (1 - POLISH_SPAN) * slowest]
    notes = _polish(rough, plans, requests, workers, memo)
    return [plan for plan in plans if plan is not None], notes


def _polish(rough: list[int], plans: list[Plan | None], requests: list[StageRequest],
            workers: int, memo: PricingMemo) -> list[str]:
    """Polish the plans of stages ``rough`` in place (``stage_solve.polished``, ``workers``
    at a time, the largest graphs first); a note saying what it did, if anything."""
    if not rough:
        return []
    rough = sorted(rough, key=lambda s: -len(requests[s].graph))
    found = [plans[s] for s in rough]
    done = fork_map(_polished, [(requests[s], plans[s], memo) for s in rough], workers,
                    unit="stage polishes")
    better = []
    for s, before, after in zip(rough, found, done):
        assert before is not None
        plans[s] = after
        old, new = stage_seconds(before, requests[s]), stage_seconds(after, requests[s])
        if new < old:
            better.append(f"{s} ({(old - new) / old:.2%})")
    log.info("pipeline stages polished (re-solved unsimplified): %d, %d of them faster",
             len(rough), len(better))
    faster = f"; faster: stage {', '.join(better)}" if better else "; none faster"
    return [f"polished {len(rough)} of the search's stage plans (stages "
            f"{', '.join(str(s) for s in sorted(rough))}, within {POLISH_SPAN:.0%} of the "
            f"slowest: re-solved unsimplified, the better plan kept){faster}"]


def _polished(job: tuple[StageRequest, Plan, PricingMemo]) -> Plan:
    """``stage_solve.polished`` of one job (``fork_map`` passes one argument)."""
    request, found, memo = job
    return polished(request, found, memo)


def place_submeshes(submeshes: list[tuple[int, int]], cluster: Cluster
                    ) -> list[tuple[int, ...]]:
    """Global ranks for each submesh: whole nodes first, then packed within nodes."""
    free = {n: list(range(n * cluster.devices_per_node, (n + 1) * cluster.devices_per_node))
            for n in range(cluster.num_nodes)}
    order = sorted(range(len(submeshes)), key=lambda s: -submeshes[s][0] * submeshes[s][1])
    ranks: dict[int, tuple[int, ...]] = {}
    for s in order:
        n, m = submeshes[s]
        if n > 1 or m == cluster.devices_per_node:
            nodes = [k for k in sorted(free) if len(free[k]) == cluster.devices_per_node][:n]
            if len(nodes) < n:
                raise ValueError(f"cannot place submesh {submeshes[s]} on the cluster")
            ranks[s] = tuple(r for k in nodes for r in free.pop(k))
        else:
            node = next((k for k in sorted(free, key=lambda k: len(free[k]))
                         if len(free[k]) >= m), None)
            if node is None:
                raise ValueError(f"cannot place submesh {submeshes[s]} on the cluster")
            ranks[s] = tuple(free[node][:m])
            free[node] = free[node][m:]
    return [tuple(sorted(ranks[s])) for s in range(len(submeshes))]


def pipeline_estimates(stages: list[StagePlan], transfers: list[Transfer],
                       method: PipeshardParallel, cluster: Cluster,
                       stage_seconds: list | None = None, received: list[float] | None = None
                       ) -> Estimates:
    """The pipeline's step time (its schedule simulated on the stages' forward, backward
    and send times, plus what crosses once per step) and memory per device (each stage's
    states, one micro-batch at its peak and what the others in flight keep)."""
    S, B = len(stages), method.num_micro_batches
    link = _stage_link(cluster)
    meshes = [submesh_cluster(cluster, s.submesh).logical_mesh(tuple(s.plan.mesh_shape))
              for s in stages]
    # what a stage pays once per step (its gradients' final resharding, the optimizer)
    # runs after its last backward, not with every micro-batch
    once_s = [s.plan.estimates.once_per_step_s or 0.0 for s in stages]
    step = list(stage_seconds) if stage_seconds is not None else \
        [known(s.plan.estimates.step_time_s) - o for s, o in zip(stages, once_s)]
    # a stage reduces its gradients after its last backward: none hidden behind it
    once_s = [o + (s.plan.estimates.hidden_gradient_s or 0.0)
              for s, o in zip(stages, once_s)]
    forward = [t * FORWARD_SHARE for t in step]   # backward is about twice forward's work
    # a recomputed stage runs its forward again in backward
    backward = [t - f + (f if s.recompute else 0.0) for t, f, s in zip(step, forward, stages)]
    step = [recompute_seconds(t) if s.recompute else t for t, s in zip(step, stages)]
    send = [sum(transfer_seconds(t, meshes, link) for t in transfers
                if t.src_stage == s and t.phase == "forward" and not t.once_per_step)
            for s in range(S)]
    schedule = SCHEDULES[method.pipeline_schedule](S, B)
    timeline = simulate(schedule, forward, backward, send)
    # once per step: parameters before the first micro-batch, summed gradient parts
    # after the last
    once = sum(t.bytes for t in transfers if t.once_per_step) / link
    total = max(max(e for _, _, _, e in stage) + o for stage, o in zip(timeline, once_s)) + once
    # a stage's peak: in its schedule (states, micro-batches in flight), or at its
    # optimizer step after the last backward (``passes/pricing/step_end.py``)
    memory = [max((recompute_memory if s.recompute else in_flight_bytes)(
        known(s.plan.estimates.model_state_bytes_per_device),
        known(s.plan.estimates.activation_bytes_per_device),
        (received or [0.0] * S)[n] if s.recompute else
        known(s.plan.estimates.saved_activation_bytes_per_device),
        in_flight(schedule[n])), s.plan.estimates.end_of_step_bytes_per_device or 0.0)
        for n, s in enumerate(stages)]
    budget = method.auto_sharding_option.memory_budget_per_device or cluster.memory_per_device
    return Estimates(step_time_s=total, max_stage_s=max(step), stage_step_s=step,
                     stage_times="measured" if stage_seconds is not None else "cost model",
                     alpa_objective_s=sum(step) + (B - 1) * max(step),
                     memory_per_device_bytes=max(memory), stage_memory_bytes=memory,
                     end_of_step_bytes_per_device=max(
                         (s.plan.estimates.end_of_step_bytes_per_device or 0.0 for s in stages),
                         default=None),
                     timeline=timeline,
                     # recorded for reports and pictures
                     memory_budget_per_device_bytes=float(budget) if budget else None)


def fastest_of(plan: PipelinePlan, alternatives: Sequence[Sequence[GivenStage]],
               assemble: Callable[[Sequence[GivenStage]], PipelinePlan]) -> PipelinePlan:
    """``plan``, or the alternative (a uniform partition whose stages the search priced
    exactly) whose estimated step is shorter. The DP ranks by its objective, sum + (B - 1)
    x max of the stage latencies; the plan's step comes from simulating the schedule, and
    the two can order near-equal pipelines differently (GPT-15B: 3 uneven stages against
    4 even ones, within 0.2 %). The alternatives' stage plans are already solved."""
    best = plan
    for alternative in alternatives:
        try:
            candidate = assemble(alternative)
        except (InfeasibleError, ValueError):
            continue
        if known(candidate.estimates.step_time_s) < known(best.estimates.step_time_s):
            best = candidate
    if best is not plan:
        log.info("pipeline search: a uniform partition priced exactly simulates faster "
                 "(%.6g s) than the DP's answer (%.6g s): taken", best.estimates.step_time_s,
                 plan.estimates.step_time_s)
    return best
