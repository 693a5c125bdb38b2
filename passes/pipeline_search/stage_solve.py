"""One pipeline stage's own intra-op plan: what it is solved from, and how hard.

A stage (a range of layers on a submesh view) is planned by the intra-op ILP with the
micro-batches its schedule keeps in flight counted in its memory; a recomputed stage is
planned with one in flight, in the budget the others' kept inputs leave
(``passes/pipeline_search/stage_recompute.py``). ``StageRequest`` is that problem as data (handed to forked
workers); ``plan_stage`` solves it, and ``cannot_fit`` proves, without an ILP, that no
plan of it fits where its memory floor is above the budget. The search's own stage
solves cap how hard the ILP works (``search_option``): none is re-solved unsimplified.
The stages of the pipeline the search picks are then polished (``polish_option``,
``polished``): re-solved as the search solved every stage before, unsimplified below
``POLISH_BELOW`` nodes, the better plan kept. Stages the search never solved are planned
with the method's option.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import AutoShardingOption, PipeshardParallel, ShardParallel
from torchalpa.core.plan import Plan
from torchalpa.passes.pipeline_search.layer_costs import micro_batch_seconds
from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
from torchalpa.passes.pipeline_search.stage_recompute import recompute_option
from torchalpa.passes.sharding.ilp import InfeasibleError
from torchalpa.passes.sharding.intra_op import (
    FIT_TOLERANCE,
    least_memory_unsaid,
    memory_floor,
    plan_intra_op,
    step_time_lower_bound,
)

__all__ = ["StageRequest", "stage_request", "plan_stage", "cannot_fit", "search_option",
           "polish_option", "polished", "polishes", "stage_seconds", "stage_time_lower_bound",
           "POLISH_BELOW", "BUDGETED_GAP"]

POLISH_BELOW = 600
"""A stage of the pipeline the search picks is polished -- re-solved unsimplified
(``AutoShardingOption.exact_below``), the better plan kept -- only when its graph has at
most this many nodes (and at most the method's ``exact_below``); the search's own stage
solves re-solve none unsimplified, and every stage solve still lets its followers decide
on their own (``AutoShardingOption.free_followers_below``). Until 2026-11-30 every stage
the search priced was so re-solved: on the origin job (LLaMA-2-13B, 50 x 4 devices, 200
micro-batches) three re-solves of its 597-node first layer took 642 of its 805 s of stage
solves and bettered those stages by 1.4-2.2 %; now only the picked stages pay it. On
GPT-39B (8 x 8 H100) the unsimplified re-solves were most of the search: 11-62 s for a
2-layer stage (794-843 nodes, ~205k columns), 23-102 s for a 4-layer one (1586-1598 nodes,
~380k columns, some stopped by the 60 s limit), where freeing the followers alone took
1-13 s and came within 0.27 % of them (``benchmarks/stage_resolve.py``; the small case is
``tests/test_free_followers.py``). The tests' small GPT stages (134-589 nodes) are still re-solved: there the
re-solve is cheap and once found a 5 % faster stage."""

BUDGETED_GAP = 0.01
"""Relative optimality gap (HiGHS' ``mip_rel_gap``) at which a budgeted stage solve (a
uniform partition's stage, priced only to offer the search an alternative) stops, at
least: a bound by work beside its node limit. A budgeted solve stops where its plan is
proved within 1 % of the stage's optimum, the AutoParallel search's own tolerance, half
the ``UNIFORM_MARGIN`` that decided to price it. GPT-39B at 128 micro-batches (8 x 8
H100): the uniform partition 4 stages on (2, 8) as (8, 2) is priced (84.10 s by its sums
against the answer's 83.14 s), and its memory-bound stages (layers 0-3 with 4
micro-batches in flight, 4-7 with 3; ~61k columns, 10k rows) took 470 + 576 s and 890 s
(load 13): layers 4-7 reached 0.96 % at HiGHS' root (its sub-MIP heuristic), then spent
about 40 s per branch-and-bound node toward the 500-node budget at HiGHS' default gap
(1e-4), where the 60-s safety net used to stop such solves by the clock. With the gap:
the same plan of that candidate at half its CPU (benchmarks/RESULTS.md, r12-stagesolve)."""


@dataclass(frozen=True)
class StageRequest:
    """A stage's intra-op problem: its graph on ``mesh``, planned with ``method`` for
    ``in_flight`` micro-batches held at once, in a step of ``micro_batches`` whose
    gradients are reduced once (``plan_intra_op``'s ``step_micro_batches``)."""

    graph: OpGraph
    mesh: LogicalMesh
    method: ShardParallel
    inputs: str
    in_flight: int
    micro_batches: int = 1


def stage_request(graph: OpGraph, mesh: LogicalMesh, method: PipeshardParallel,
                  option: AutoShardingOption | None, inputs: str, flight: int,
                  received: float | None) -> StageRequest:
    """What ``plan_stage`` plans a stage from; a recomputed stage (``received``: the
    bytes each other micro-batch in flight keeps) with one micro-batch in flight and the
    budget the others leave (``passes/pipeline_search/stage_recompute.py``)."""
    if received is None:
        return StageRequest(graph, mesh, method.intra_op_method(option), inputs, flight,
                            method.num_micro_batches)
    budget = method.auto_sharding_option.memory_budget_per_device or mesh.memory_per_device
    lowered = recompute_option(option or method.auto_sharding_option, budget, received, flight)
    if lowered is None:
        assert budget is not None, "recompute_option lowers only a budget it is given"
        raise InfeasibleError(f"a recomputed stage keeps {flight - 1} micro-batches' inputs "
                              f"of {received / 2**30:.2f} GiB each, more than the "
                              f"{budget / 2**30:.1f} GiB budget per device")
    return StageRequest(graph, mesh, method.intra_op_method(lowered), inputs, 1,
                        method.num_micro_batches)


def plan_stage(request: StageRequest, memo: PricingMemo | None = None) -> Plan:
    """The stage's intra-op plan (``InfeasibleError`` if none fits); ``memo``: as in
    ``plan_intra_op``."""
    graph = request.graph
    return plan_intra_op(graph, request.mesh, request.method, inputs=request.inputs,
                         in_flight=request.in_flight,
                         blocks=graph.meta.get("repeated_blocks") or None, memo=memo,
                         step_micro_batches=request.micro_batches)


def cannot_fit(request: StageRequest, memo: PricingMemo | None = None) -> bool:
    """Whether no plan of ``request``'s stage fits its memory budget, proved without an ILP
    (``intra_op.memory_floor``: what every plan holds at some point, each value at its
    least, above the budget). Where it says so, ``plan_stage`` on ``request``, or on it
    with sharded states (a subset of the strategies, the same budget), could only raise
    ``InfeasibleError``, stop, or leave memory unsettled: every solve the search would
    run for the stage ends without a plan. False says nothing: the ILP decides."""
    floor, budget = memory_floor(request.graph, request.mesh, request.method,
                                 inputs=request.inputs, in_flight=request.in_flight,
                                 memo=memo, step_micro_batches=request.micro_batches)
    return budget is not None and floor > budget * (1 + FIT_TOLERANCE)


def stage_time_lower_bound(request: StageRequest, memo: PricingMemo | None = None
                           ) -> float | None:
    """Seconds per micro-batch (``layer_costs.micro_batch_seconds``) that no plan
    ``plan_stage`` returns for ``request`` has: the LP bound of ``step_time_lower_bound``
    on the ILP's objective, which counts a micro-batch's work ``micro_batches`` times and
    what is paid once per step once, divided by ``micro_batches`` (a plan's seconds per
    micro-batch are its objective so divided: equal to rounding on the stages of
    ``tests/search_models.py``). None where there is no bound; ``InfeasibleError`` where the
    relaxation has no point (no plan fits whatever the memory)."""
    found = step_time_lower_bound(request.graph, request.mesh, request.method,
                                  inputs=request.inputs, memo=memo,
                                  blocks=request.graph.meta.get("repeated_blocks") or None,
                                  step_micro_batches=request.micro_batches)
    return None if found is None else found / request.micro_batches


def search_option(option: AutoShardingOption, budget: int | None, nodes: int = 0
                  ) -> AutoShardingOption:
    """``option`` for a stage solve of the search on a graph of ``nodes`` nodes: no
    unsimplified re-solve (``exact_below`` 0 where the graph is small enough for one, the
    picked stages being polished after, ``polish_option``; above that the same solve as
    the polish option's, and recorded as it) and, with ``budget`` branch-and-bound nodes
    (a uniform partition's stage, an alternative to the answer), its solver's node limit
    at most that, its gap at least ``BUDGETED_GAP`` and no alternating re-solve of
    repeated blocks (``AutoShardingOption.alternate_blocks``: on GPT-39B's 64-device row
    the slowest such stage, layers 0-1 with 4 micro-batches in flight, took 18.8 s with
    it and 10.1 s without, at the same latency). Bounds by work: the method's
    ``time_limit`` stays the only clock."""
    below = polish_option(option).exact_below
    if nodes <= below:
        below = 0
    if budget is None:
        return option if below == option.exact_below else replace(option, exact_below=below)
    nodes_cap = budget if option.max_nodes is None else min(option.max_nodes, budget)
    gap = BUDGETED_GAP if option.gap is None else max(option.gap, BUDGETED_GAP)
    return replace(option, max_nodes=nodes_cap, gap=gap, exact_below=below,
                   alternate_blocks=False)


def polish_option(option: AutoShardingOption) -> AutoShardingOption:
    """``option`` for polishing a picked stage: re-solved unsimplified at most up to
    ``POLISH_BELOW`` nodes (the option every stage solve of the search had until
    2026-11-30, so a polished stage is the plan that search made for it)."""
    below = min(option.exact_below, POLISH_BELOW)
    return option if below == option.exact_below else replace(option, exact_below=below)


def stage_seconds(plan: Plan, request: StageRequest) -> float:
    """What the stage DP compares a stage plan by: its seconds per micro-batch."""
    return micro_batch_seconds(plan.estimates, request.micro_batches)


def polishes(request: StageRequest) -> bool:
    """Whether polishing ``request``'s stage re-solves anything the search's solve did
    not: its graph is small enough to solve unsimplified (``polish_option``)."""
    return 0 < len(request.graph) <= polish_option(
        request.method.auto_sharding_option).exact_below


def polished(request: StageRequest, found: Plan, memo: PricingMemo | None = None) -> Plan:
    """The better of ``found`` (the search's plan of ``request``'s stage) and the stage
    re-solved with ``polish_option`` (the plan kept on a tie: the polished one, as the
    search made it before). Never slower than ``found`` by ``stage_seconds``; a re-solve
    that finds nothing (``InfeasibleError``) keeps ``found``, so the least memory such a
    re-solve would need is never solved (``least_memory_unsaid``)."""
    method = request.method
    again = replace(request, method=replace(
        method, auto_sharding_option=polish_option(method.auto_sharding_option)))
    try:
        with least_memory_unsaid():
            plan = plan_stage(again, memo)
    except InfeasibleError:
        return found
    return plan if stage_seconds(plan, request) <= stage_seconds(found, request) else found
