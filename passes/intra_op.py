"""The intra-op pass: OpGraph + logical mesh + options -> Plan.

1. strategies for every node from its rule (replicate-only for ops without one);
2. costs: compute per strategy, resharding per edge (the redistribution planner priced
   by the alpha-beta model), the loss gathered whole on every device, each gradient
   brought to its parameter's layout;
3. the ILP picks one strategy per node;
4. the choice becomes a Plan: placements, every resharding step, the collectives they
   issue, and estimates of step time and memory.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph, TensorSpec, ValueRef
from torchalpa.core.options import AutoShardingOption, ShardParallel
from torchalpa.core.placement import Placements, Shard, format_placements, is_shard, replicated
from torchalpa.core.plan import (
    INPUT_SLOT,
    OUTPUT,
    Collective,
    MeshStage,
    NodeStrategy,
    OutputSlot,
    Plan,
    Reshard,
    ValuePlacement,
    state_read_once,
)
from torchalpa.core.plan_records import Estimates, Explanation, LayoutCost
from torchalpa.core.units import format_bytes
from torchalpa.passes.attention_price import saved_statistics
from torchalpa.passes.constraints import apply_constraints
from torchalpa.passes.cost import (
    batch_sync_cost,
    compute_cost,
    gradient_steps_cost,
    optimizer_cost,
    steps_cost,
    strategy_bytes,
    wire_bytes,
)
from torchalpa.passes.costgraph import ReshardCosts, cached_reshard_costs, solve_sharing_reads
from torchalpa.passes.fused_pricing import priced_as
from torchalpa.passes.ilp import ILPProblem, InfeasibleError, SolverStopped, solve_ilp
from torchalpa.passes.inplace_pricing import priced_in_place
from torchalpa.passes.memory import MemoryModel, activation_peak_bytes, model_state_bytes
from torchalpa.passes.reshard import local_bytes, plan_reshard
from torchalpa.passes.rules import rule_for
from torchalpa.passes.shared_reshard import read_key
from torchalpa.passes.simplify import group_nodes
from torchalpa.passes.strategies import (
    Strategy,
    enumerate_strategies,
    leaf_strategies,
    replicate_only,
    splits_over_both_axes,
    sync_steps,
)
from torchalpa.passes.strides import strided_regions

__all__ = ["plan_intra_op", "step_time_lower_bound", "UnsupportedOpWarning", "build_strategies",
           "assemble_plan", "merge_gradient_all_reduces", "planned_for", "intra_op_problem",
           "rule_strategies"]

log = logging.getLogger("torchalpa.planner")


class UnsupportedOpWarning(UserWarning):
    """An op has no sharding rule and runs replicated."""


@dataclass
class StrategySpace:
    strategies: dict[str, list[Strategy]]
    unsupported: list[dict]
    notes: list[str]
    heavy: frozenset = frozenset()   # nodes whose rule says compute-bound
    random: frozenset = frozenset()  # nodes whose rule says they draw random numbers


def build_strategies(graph: OpGraph, mesh: LogicalMesh, inputs: str = "global",
                     option: AutoShardingOption | None = None) -> StrategySpace:
    """Every node's candidate strategies; ops without a rule get replicate-only."""
    strategies: dict[str, list[Strategy]] = {}
    unsupported: list[dict] = []
    heavy, random = set(), set()
    regions = strided_regions(graph)
    for node in graph:
        strides = regions.get(node.name, ())
        if node.is_leaf:
            options = leaf_strategies(node.output, mesh, strides)
            if node.kind == "input" and inputs == "local":
                options = [_batch_sharded(node.output, mesh)]
            strategies[node.name] = options
            continue
        rule = rule_for(node, graph)
        if rule is not None and rule.random:
            random.add(node.name)
            if option is not None and option.random == "replicated":
                rule = replace(rule, blocked=frozenset(rule.factors()))   # drawn whole
        if rule is not None and rule.heavy:
            heavy.add(node.name)
        options = []
        if rule is not None:
            options = list(rule_strategies(
                rule, mesh, option is not None and option.allow_recompute_heavy_op, strides))
        if not options:
            if rule is None:
                unsupported.append({"op": node.op, "node": node.name, "module": node.module,
                                    "stack": node.stack})
            options = replicate_only(node, mesh)
        strategies[node.name] = options
    if option is not None and not option.allow_mixed_mesh_shape and mesh.ndim > 1:
        for name, options in strategies.items():
            kept = [s for s in options if not splits_over_both_axes(s, mesh)]
            if kept:
                strategies[name] = kept
    notes = apply_constraints(graph, strategies, mesh, option) if option is not None else []
    _prune_unreachable(graph, strategies, mesh)
    for item in unsupported:
        warnings.warn(f"no sharding rule for {item['op']} (node {item['node']}"
                      + (f", module '{item['module']}'" if item["module"] else "")
                      + (f", at {item['stack']}" if item["stack"] else "")
                      + "): it runs replicated on every device", UnsupportedOpWarning,
                      stacklevel=3)
    return StrategySpace(strategies, unsupported, notes, frozenset(heavy), frozenset(random))


_RULE_STRATEGIES: dict[tuple, list[Strategy]] = {}
_REACHABLE: dict[tuple, dict] = {}
_MEMO_ENTRIES = 200_000
"""Bound on each process-wide memo below (cleared when full)."""


def rule_strategies(rule, mesh: LogicalMesh, recompute_heavy: bool,
                     strides: tuple[tuple[int, int], ...] = ()) -> list[Strategy]:
    """``enumerate_strategies``, memoized for the process: it depends on the rule, the
    mesh's shape and the flag only, and the pipeline search asks for the same rules on the
    same views many times (every layer, lean variant, remat capture and stage solve);
    enumerating them again was an eighth of GPT-1.3B's search (profiled). Strategies
    are frozen, so the lists' items may be shared."""
    key = (rule, mesh.shape, recompute_heavy, strides)
    found = _RULE_STRATEGIES.get(key)
    if found is None:
        if len(_RULE_STRATEGIES) >= _MEMO_ENTRIES:
            _RULE_STRATEGIES.clear()
        found = _RULE_STRATEGIES[key] = enumerate_strategies(rule, mesh, recompute_heavy,
                                                             strides)
    return found


def _prune_unreachable(graph: OpGraph, strategies: dict[str, list[Strategy]],
                       mesh: LogicalMesh) -> None:
    """Drop strategies that read an operand in a layout no producer strategy can be
    resharded into (e.g. a Partial input downstream of ops that never make one). The
    answers depend on the tensor, the layouts and the mesh's shape only: kept for the
    process, per mesh shape."""
    if len(_REACHABLE) >= 64 or sum(len(v) for v in _REACHABLE.values()) >= _MEMO_ENTRIES:
        _REACHABLE.clear()
    shared = _REACHABLE.setdefault(mesh.shape, {})   # (spec, sources) -> {want: reachable?}
    by_operand: dict = {}    # (producer, output index) -> (spec, its layouts, that dict)

    def reachable(ref, want) -> bool:
        entry = by_operand.get((ref.node, ref.index))
        if entry is None:
            spec = graph.spec(ref)
            sources = frozenset(p.outputs[ref.index] for p in strategies[ref.node])
            entry = by_operand[(ref.node, ref.index)] = (
                spec, sources, shared.setdefault((spec, sources), {}))
        spec, sources, answers = entry
        answer = answers.get(want)
        if answer is None:
            answer = answers[want] = any(plan_reshard(spec, src, want, mesh.shape) is not None
                                         for src in sources)
        return answer

    for node in graph.ops():
        keep = [s for s in strategies[node.name]
                if all(s.inputs[k] is None or reachable(ref, s.inputs[k])
                       for k, ref in enumerate(node.operands))]
        if keep:
            strategies[node.name] = keep


def _batch_sharded(spec: TensorSpec, mesh: LogicalMesh) -> Strategy:
    """``inputs='local'``: each device already holds its slice of the batch (dim 0)."""
    if spec.shape and spec.shape[0] % mesh.num_devices:
        raise ValueError(f"inputs='local' needs the batch dim ({spec.shape[0]}) divisible by "
                         f"the {mesh.num_devices} devices")
    return Strategy(inputs=(), outputs=(tuple(Shard(0) for _ in mesh.shape),))


def plan_intra_op(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel | None = None, *,
                  inputs: str = "global", blocks: dict[str, tuple[str, int]] | None = None,
                  in_flight: int = 1) -> Plan:
    """Solve Alpa's intra-op ILP for ``graph`` on ``mesh`` and return the Plan.

    ``blocks`` (node -> (block kind, index)) lets identical layers share one decision.
    ``in_flight``: micro-batches whose activations must fit in memory at once (a pipeline
    stage's; the estimates still describe one micro-batch).
    """
    method = method or ShardParallel()
    start = time.perf_counter()
    option, mesh, graph, space, costs = intra_op_problem(graph, mesh, method, inputs)
    S = space.strategies
    budget = option.memory_budget_per_device or mesh.memory_per_device
    # a parameter's forward reshards run once per step (runtime/param_gather.py)
    state_once = state_read_once(method.num_micro_batches, option.rematerialize_parameters)
    if option.force_simple_heuristic or not option.enable_auto_sharding:
        chosen = _propagate(graph, S, costs, mesh,
                            by_size=option.force_simple_heuristic == "shard-largest")
        plan = merge_gradient_all_reduces(
            assemble_plan(graph, mesh, method, chosen, costs, space, inputs), graph, mesh, option)
        return _replace_estimates(plan, dict(plan.estimates, objective=plan.estimates[
            "step_time_s"], solve_seconds=time.perf_counter() - start))

    def solve(period: int, start: dict[str, Strategy] | None = None, exact: bool = False,
              shared: frozenset = frozenset(), followers: bool = True):
        grouping = group_nodes(graph, S, None if exact else blocks, heavy=space.heavy,
                               period=period, merge_followers=followers and not exact)
        memory = MemoryModel(graph, S, grouping, mesh.shape, method.optimizer_states, in_flight,
                             saved_statistics(graph, mesh), state_at_start=state_once)
        initial = None
        if start is not None:    # a plan of a coarser grouping is feasible here too
            initial = {}
            for k in grouping.representatives:
                position = {id(S[k][i]): a for a, i in enumerate(grouping.index[k])}
                if id(start[k]) in position:
                    initial[k] = position[id(start[k])]
        cg, solution, chosen, shared = solve_sharing_reads(
            graph, mesh, S, grouping, costs,
            lambda cg, initial: _solve_within_memory(graph, S, grouping, cg, memory, budget,
                                                     option, mesh, initial=initial),
            initial, shared, micro_batches=method.num_micro_batches, state_once=state_once)
        return grouping, cg, solution, chosen, shared

    def resolve(what: str, **less_simplified) -> None:
        """Solve again, from the plan found, with ``less_simplified`` letting more nodes
        decide apart; keep the better plan."""
        nonlocal grouping, cg, solution, chosen, shared
        try:
            found = solve(1, start=chosen, shared=shared, **less_simplified)
        except InfeasibleError as e:    # a time limit without a solution: keep what we have
            log.warning("the ILP with %s found no plan (%s); keeping the plan found, which "
                        "may not be optimal", what, e)
            return
        if found[2].objective < solution.objective * (1 - 1e-9):
            log.info("the ILP with %s improved the plan: %.6g -> %.6g", what,
                     solution.objective, found[2].objective)
            grouping, cg, solution, chosen, shared = found

    built = time.perf_counter()
    found = None
    frees = len(graph) <= option.free_followers_below and len(group_nodes(
        graph, S, blocks, heavy=space.heavy, merge_followers=False).representatives) > \
        len(group_nodes(graph, S, blocks, heavy=space.heavy).representatives)
    # a follower takes its operand's layout; deciding on its own it may avoid a reshard
    # the merge forces (GPT's stages: the gain of the unsimplified re-solve)
    if frees and len(graph) > option.exact_below:
        # its problem contains the simplified one, so it is solved instead of it: on
        # GPT-39B's memory-bound stages solving the simplified ILP first and this one
        # from its plan took 1.2-4x as long, for a plan no better
        try:
            found = solve(1, followers=False)
        except SolverStopped as e:
            log.warning("the ILP with free followers found no plan in time (%s); solving "
                        "the simplified one", e)
    grouping, cg, solution, chosen, shared = found or solve(1)
    if frees and found is None and len(graph) <= option.exact_below:
        # re-solved unsimplified below: from the freed plan that solve is much shorter
        # (pipeline_vs_3d's pp4 dp4 tp4 grid, 4-layer GPT-39B stages: planned in 23.3 s,
        # 128.7 s from the simplified plan), and plans that tie stay the simplified ILP's
        # (Alpa's tests pin such tie-breaks)
        resolve("free followers", followers=False)
    exact_next = len(graph) <= option.exact_below and len(cg.node_costs) < len(graph)
    # the unsimplified problem contains the alternating one (and starts from this plan):
    # where it is solved next, the alternating solve would only repeat part of its work
    if not exact_next and blocks and option.alternate_blocks and \
            _reshards_between_blocks(graph, blocks, chosen, costs) > 0.01 * solution.objective:
        # shared layers cannot alternate; let every other layer decide apart, keep the best
        alternative = solve(2, start=chosen, shared=shared)
        if alternative[2].objective < solution.objective:
            grouping, cg, solution, chosen, shared = alternative
    if exact_next:
        # shared decisions and followers restrict the problem; on a graph this small,
        # solve the full problem too (from the plan found) so they never cost optimality
        resolve("nothing simplified", exact=True)
    plan = merge_gradient_all_reduces(assemble_plan(graph, mesh, method, chosen, costs, space,
                                                 inputs), graph, mesh, option)
    seconds = time.perf_counter() - start
    num_strategies = sum(len(v) for v in S.values())
    log.info("intra-op plan on mesh %s: %d nodes (%d decide), %d strategies, %d/%d edges "
             "priced, ILP %d vars, solved in %.2fs (build %.2fs), objective %.6g",
             mesh.shape, len(graph), len(cg.node_costs), num_strategies, cg.num_priced,
             cg.num_edges, solution.num_variables, solution.seconds, built - start,
             solution.objective)
    estimates = dict(plan.estimates, objective=solution.objective, solve_seconds=seconds,
                     ilp_seconds=solution.seconds, ilp_variables=solution.num_variables,
                     num_strategies=num_strategies, num_decisions=len(cg.node_costs),
                     flops_per_step=float(sum(node.flops for node in graph)))
    if mesh.peak_flops is not None:      # with flops_per_step: the MFU of a measured step
        estimates["peak_flops_per_device"] = float(mesh.peak_flops)
    if budget:
        estimates["memory_budget_bytes"] = float(budget)
    plan = _replace_estimates(plan, estimates)
    target = planned_for(mesh, budget)
    return replace(plan, notes=plan.notes + (target,)) if target else plan


def intra_op_problem(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel, inputs: str):
    """What the ILP is built from: the option in effect (pins of a manual option added),
    the mesh as priced (gradients in the runtime's buckets), the graph as priced, every
    node's strategies and the resharding costs."""
    if inputs not in ("global", "local"):
        raise ValueError(f"inputs must be 'global' or 'local', got {inputs!r}")
    option = method.auto_sharding_option
    manual = getattr(method, "manual_sharding_option", None)
    if manual is not None:
        option = replace(option, pin=option.pin + manual.pin)
    option, mesh = effective_option(option, mesh)
    graph = priced_in_place(priced_as(graph, option.elementwise))
    if mesh.gradient_bucket_bytes > 0 and option.all_reduce_threshold is not None:
        # the runtime packs gradients into buckets of the plan's threshold: price those
        mesh = replace(mesh, gradient_bucket_bytes=float(option.all_reduce_threshold))
    space = build_strategies(graph, mesh, inputs, option)
    costs = cached_reshard_costs(mesh, option.allow_reduce_scatter, forbidden_collectives(option))
    return option, mesh, graph, space, costs


def step_time_lower_bound(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel | None = None,
                          *, inputs: str = "global") -> float | None:
    """Seconds that no plan ``plan_intra_op`` could return for ``graph`` on ``mesh`` has an
    estimated step below: the linear relaxation of the unsimplified problem (every node
    deciding on its own, which the simplified problems, the memory constraints and the
    every-other-layer alternative only restrict), with every value read twice priced
    at ``1/k`` of each of its ``k`` reads (however many share one resharded copy, the
    dearest read is paid, and it is at least their mean). An LP of a second or two where the
    ILP it bounds may run for minutes: ``plan_graph`` skips a logical mesh whose bound is
    above a plan it already has.

    None where there is no such bound: no ILP (the heuristics), no HiGHS, or a plan whose
    estimated step the all-reduce combiner lowers after the solve (Alpa's accounting on a
    hand-built mesh, where the step is below the objective)."""
    from torchalpa.passes.costgraph import build_cost_graph
    from torchalpa.passes.ilp import lower_bound
    method = method or ShardParallel()
    option, mesh, graph, space, costs = intra_op_problem(graph, mesh, method, inputs)
    if option.force_simple_heuristic or not option.enable_auto_sharding:
        return None
    if option.all_reduce_threshold and mesh.gradient_bucket_bytes <= 0:
        return None                     # merge_gradient_all_reduces may subtract latencies
    S = space.strategies
    grouping = group_nodes(graph, S, None, heavy=space.heavy, period=1, merge_followers=False)
    reads: dict[tuple[str, int], int] = defaultdict(int)
    for node in graph.ops():
        for ref in node.operands:
            reads[(ref.node, ref.index)] += 1
    cg = build_cost_graph(graph, mesh, S, grouping, costs, read_weights={
        v: 1.0 / k for v, k in reads.items()
        if k > 1 and graph.node(v[0]).kind not in ("param", "buffer")},
        micro_batches=method.num_micro_batches,
        state_once=state_read_once(method.num_micro_batches, option.rematerialize_parameters))
    return lower_bound(ILPProblem(node_costs=cg.node_costs, edges=cg.edges))


def planned_for(mesh: LogicalMesh, budget: float | None) -> str | None:
    """"planned for NVIDIA H100 80GB HBM3 (nccl), memory budget 77.0 GiB per device"."""
    if not mesh.device_name and not budget:
        return None
    device = mesh.device_name or "unnamed devices"
    limit = f"memory budget {format_bytes(budget)} per device" if budget else "no memory budget"
    return f"planned for {device} ({mesh.backend}), {limit}"


def effective_option(option: AutoShardingOption, mesh: LogicalMesh
                     ) -> tuple[AutoShardingOption, LogicalMesh]:
    """What the options amount to on this mesh. ``force_data_parallel`` plans on the mesh
    flattened to one axis (its largest latency and smallest inverse bandwidth, as Alpa's
    ``LogicalDeviceMesh.flatten``), the batch split over it, no all-gather, no all-to-all."""
    if option.force_data_parallel:
        if mesh.ndim > 1:
            assert mesh.alpha is not None and mesh.beta is not None  # __post_init__ fills them
            mesh = replace(mesh, shape=(mesh.num_devices,), alpha=(max(mesh.alpha),),
                           beta=(min(mesh.beta),), axis_names=None)
        option = replace(option, force_batch_dim_to_mesh_dim=-1, allow_all_gather=False,
                         allow_all_to_all=False)
    if not option.enable_auto_sharding:   # whole unless pinned, and whole work allowed
        option = replace(option, allow_recompute_heavy_op=True, parameters=(
            "replicated" if option.parameters == "auto" else option.parameters))
    return option, mesh


def forbidden_collectives(option: AutoShardingOption) -> frozenset:
    """Collective kinds resharding may not use under ``option``."""
    return frozenset(k for k, allowed in (("all_gather", option.allow_all_gather),
                                          ("all_to_all", option.allow_all_to_all))
                     if not allowed)


def _propagate(graph: OpGraph, S: dict[str, list[Strategy]], costs: ReshardCosts,
               mesh: LogicalMesh, by_size: bool) -> dict[str, Strategy]:
    """No search: every node, in order, takes a strategy its operands' chosen layouts can
    reach -- the one holding the fewest bytes per device (``by_size``, Alpa's
    'shard-largest'), or else the cheapest to reach, whole results on ties (layouts
    spread from the pinned ones, as sharding propagation does)."""
    chosen: dict[str, Strategy] = {}
    for node in graph:
        best, best_key = None, None
        for s in S[node.name]:
            cost = sum(costs.cost(graph.spec(ref), chosen[ref.node].outputs[ref.index],
                                  s.inputs[k]) for k, ref in enumerate(node.operands))
            if math.isinf(cost):
                continue
            held = sum(local_bytes(spec, p, mesh.shape) for spec, p in zip(node.outputs,
                                                                           s.outputs))
            key = (held, cost) if by_size else (cost, -held)
            if best_key is None or key < best_key:
                best, best_key = s, key
        if best is None:
            raise ValueError(f"no layout of {node.name} ({node.op}) can be reached from its "
                             "operands' layouts under the given options; allow all-gather "
                             "and all-to-all, or pin fewer layouts")
        chosen[node.name] = best
    return chosen


def _gradient_values(graph: OpGraph) -> set[tuple[str, int]]:
    """Parameter gradients and the values they are views of (same size, single-result
    ops whose every use leads only to gradient outputs): what an all-reduce combiner may
    merge. Values as (node, result index)."""
    found = {(ref.node, ref.index) for _, ref in graph.outputs.grads}
    other = {(ref.node, ref.index) for ref in
             ([graph.outputs.loss] if graph.outputs.loss else [])}
    other |= {(ref.node, ref.index) for _, ref in graph.outputs.buffer_updates}
    other |= {(ref.node, ref.index) for ref in graph.outputs.sends}
    found -= other
    users: dict[tuple[str, int], list[str]] = {}
    for n in graph.ops():
        for ref in n.operands:
            users.setdefault((ref.node, ref.index), []).append(n.name)
    for n in reversed(list(graph.ops())):
        key = (n.name, 0)
        used = users.get(key, [])
        if len(n.outputs) != 1 or key in other or key in found or not used:
            continue
        if all(len(graph.node(u).outputs) == 1 and (u, 0) in found
               and graph.node(u).outputs[0].numel == n.outputs[0].numel for u in used):
            found.add(key)
    return found


def merge_gradient_all_reduces(plan: Plan, graph: OpGraph, mesh: LogicalMesh,
                                option: AutoShardingOption) -> Plan:
    """Alpa's all-reduce combiner on the plan: gradient all-reduces on one mesh axis are
    packed, in order, into buckets of at most ``all_reduce_threshold`` bytes; each bucket
    pays one latency instead of one per gradient. The buckets are listed in
    ``estimates['gradient_buckets']`` (their tensors, and the positions of their
    collectives in ``plan.collectives``); the collectives stay listed one per gradient."""
    threshold = option.all_reduce_threshold
    if threshold is None:
        return plan
    grads = _gradient_values(graph)
    buckets: list[dict] = []
    open_bucket: dict[int, dict] = {}
    position = -1                   # plan.collectives lists the reshards' steps first, in order
    for r in plan.reshards:
        for step in r.steps:
            if not step.is_collective:
                continue
            position += 1
            if step.kind != "all_reduce" or (r.producer, r.index) not in grads \
                    or mesh.shape[step.axis] == 1:
                continue
            bucket = open_bucket.get(step.axis)
            if bucket is None or bucket["bytes"] + step.bytes > threshold:
                bucket = open_bucket[step.axis] = {"axis": step.axis, "bytes": 0,
                                                   "tensors": [], "collectives": []}
                buckets.append(bucket)
            bucket["bytes"] += step.bytes
            bucket["tensors"].append(r.producer)
            bucket["collectives"].append(position)
    assert position == sum(1 for r in plan.reshards for st in r.steps if st.is_collective) - 1
    assert mesh.alpha is not None  # LogicalMesh.__post_init__ fills it
    # a mesh that prices buckets (gradient_bucket_bytes) already charged each gradient its
    # share of a bucket's latency; Alpa's accounting charged one each, merged here
    saved = 0.0 if mesh.gradient_bucket_bytes > 0 else \
        sum((len(b["tensors"]) - 1) * mesh.alpha[b["axis"]] for b in buckets)
    e = plan.estimates
    return _replace_estimates(plan, dict(e, gradient_buckets=buckets,
                                         step_time_s=e["step_time_s"] - saved,
                                         communication_s=e["communication_s"] - saved))


def _reshards_between_blocks(graph: OpGraph, blocks: dict, chosen: dict[str, Strategy],
                             costs: ReshardCosts) -> float:
    """What values pay to change layout where they enter or leave a repeated block (from
    another block, or from ops between blocks, such as an activation the parent module
    applies between ``ModuleList`` layers)."""
    total = 0.0
    for node in graph.ops():
        mine = blocks.get(node.name)
        for slot, ref in enumerate(node.operands):
            theirs = blocks.get(ref.node)
            if theirs == mine or graph.node(ref.node).is_leaf:
                continue
            src = chosen[ref.node].outputs[ref.index]
            total += costs.cost(graph.spec(ref), src, chosen[node.name].inputs[slot])
    return total


def _describe(mesh: LogicalMesh) -> str:
    if mesh.ndim == 1:
        return f"1D mesh of {mesh.num_devices} devices"
    return f"mesh of {'x'.join(map(str, mesh.shape))}"


def _expand(graph, S, grouping, choice) -> dict[str, Strategy]:
    return {n.name: S[n.name][grouping.index[n.name][choice[grouping.rep[n.name]]]]
            for n in graph}


def _timeline(graph, memory: MemoryModel, chosen: dict[str, Strategy], mesh, optimizer_states
              ) -> np.ndarray:
    state = model_state_bytes(graph, {k: s.outputs[0] for k, s in chosen.items()
                                      if graph.node(k).is_leaf}, mesh.shape, optimizer_states)
    return memory.timeline({k: s.outputs for k, s in chosen.items()}, state)


def _peak(graph, memory: MemoryModel, chosen: dict[str, Strategy], mesh, optimizer_states
          ) -> tuple[float, int]:
    timeline = _timeline(graph, memory, chosen, mesh, optimizer_states)
    t = int(np.argmax(timeline))
    return float(timeline[t]), t


def _violations(timeline: np.ndarray, budget: float, most: int = 8) -> list[int]:
    """Points to constrain next: the peak and others spread over where the plan is over."""
    over = np.flatnonzero(timeline > budget)
    if over.size == 0:
        return []
    picks = {int(np.argmax(timeline))}
    picks |= {int(over[i]) for i in np.linspace(0, over.size - 1, min(most, over.size)).astype(int)}
    return sorted(picks)


def _solve_within_memory(graph, S, grouping, cg, memory: MemoryModel, budget, option, mesh,
                         max_rounds: int = 20, initial: dict[str, int] | None = None):
    """Solve; while the plan's true peak exceeds the budget, constrain memory there too."""
    from dataclasses import replace as _replace
    states = memory.optimizer_states
    problem = ILPProblem(node_costs=cg.node_costs, edges=cg.edges, shared=cg.shared)
    points: list[int] = []
    worst = memory.upper_timeline() if budget is not None else None
    if worst is not None and worst.max(initial=0) > budget:
        # the budget may bind: from the first solve on, constrain the likely peaks and
        # points spread over where memory could exceed it (constraints an optimal plan
        # meets anyway; they spare the solver regions a later round would cut off)
        points = sorted(set(memory.likely_peaks()) | set(_violations(worst, budget)))
        problem = _replace(problem, memory_terms=[memory.terms_at(p) for p in points],
                           memory_budget=budget)
    for _ in range(max_rounds):
        try:
            solution = solve_ilp(problem, solver=option.solver, time_limit=option.time_limit,
                                 gap=option.gap, initial=initial)
        except SolverStopped:
            raise
        except InfeasibleError:
            if not points:
                raise
            need = _minimum_memory(graph, S, grouping, cg, memory, points, option, mesh, states)
            raise InfeasibleError(
                f"the model does not fit in {format_bytes(budget)} per device on a "
                f"{_describe(mesh)}: it needs at least {format_bytes(need)} "
                "per device (parameters, gradients, optimizer states and activations); use "
                "more devices, a smaller batch, or a larger memory_budget_per_device") from None
        chosen = _expand(graph, S, grouping, solution.choice)
        if budget is None:
            return solution, chosen
        timeline = _timeline(graph, memory, chosen, mesh, states)
        peak = float(timeline.max(initial=0))
        log.info("memory: %d points constrained, ILP %.2fs, peak %s (budget %s)", len(points),
                 solution.seconds, format_bytes(peak), format_bytes(budget))
        if peak <= budget * (1 + 1e-9):
            return solution, chosen
        new_points = [p for p in memory.likely_peaks() + _violations(timeline, budget)
                      if p not in points]
        if not new_points:
            break
        points += new_points
        problem = _replace(problem, memory_terms=[memory.terms_at(p) for p in points],
                           memory_budget=budget)
    raise InfeasibleError(f"could not fit the plan in {format_bytes(budget)} per device after "
                          f"{max_rounds} rounds of memory constraints")


def _minimum_memory(graph, S, grouping, cg, memory: MemoryModel, points, option, mesh,
                    states) -> float:
    """The smallest peak any plan reaches (refining the checked points until exact)."""
    points = list(points)
    for _ in range(20):
        problem = ILPProblem(node_costs=cg.node_costs, edges=cg.edges, minimize_peak=True,
                             memory_terms=[memory.terms_at(p) for p in points])
        solution = solve_ilp(problem, solver=option.solver, time_limit=option.time_limit)
        peak, t = _peak(graph, memory, _expand(graph, S, grouping, solution.choice), mesh, states)
        if t in points or peak <= solution.objective * (1 + 1e-9):
            return peak
        points.append(t)
    return peak


def _explain_parameters(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel,
                        chosen: dict[str, Strategy], costs: ReshardCosts,
                        space: StrategySpace) -> dict[str, Explanation]:
    """Per parameter: what its layout costs (communication it causes, state it holds) and
    what the best other layout would cost with every other decision unchanged."""
    readers: dict[str, list[tuple[str, int]]] = {}
    for node in graph.ops():
        for slot, ref in enumerate(node.operands):
            if graph.node(ref.node).kind in ("param", "buffer"):
                readers.setdefault(ref.node, []).append((node.name, slot))
    grads = {graph.params[fqn]: ref for fqn, ref in graph.outputs.grads}
    out = {}
    for node in graph:
        if node.kind not in ("param", "buffer"):
            continue

        def price(layout):
            t = sum(costs.cost(node.output, layout, chosen[v].inputs[slot])
                    for v, slot in readers.get(node.name, []))
            g = grads.get(node.name)
            if g is not None:
                t += costs.cost(graph.spec(g), chosen[g.node].outputs[g.index], layout,
                                gradient=True)
            copies = 2 + method.optimizer_states if g is not None else 1
            return LayoutCost(placements=tuple(format_placements(layout)), communication_s=t,
                              state_bytes=local_bytes(node.output, layout, mesh.shape) * copies)

        mine = chosen[node.name].outputs[0]
        others = [price(s.outputs[0]) for s in space.strategies[node.name]
                  if s.outputs[0] != mine]
        out[node.target] = Explanation(price(mine), min(
            others, key=lambda o: (o.communication_s, o.state_bytes)) if others else None)
    return out


def _replace_estimates(plan: Plan, estimates: dict) -> Plan:
    from dataclasses import replace
    return replace(plan, estimates=Estimates.from_dict(estimates))


def assemble_plan(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel,
              chosen: dict[str, Strategy], costs: ReshardCosts, space: StrategySpace,
              inputs: str) -> Plan:
    R = replicated(mesh.ndim)
    reshards: list[Reshard] = []
    first_read: dict = {}     # (value, steps) -> the operand read that reshards it first

    def add(ref: ValueRef, consumer: str, slot, dst: Placements | None):
        src = chosen[ref.node].outputs[ref.index]
        steps = costs.steps(graph.spec(ref), src, dst)
        assert steps is not None, (ref, consumer, slot, src, dst)
        if isinstance(slot, int):    # operand reads alike share one resharded copy
            key = read_key(graph, chosen, costs.steps, ref, dst)
            if key is not None and key in first_read:
                reshards.append(Reshard(ref.node, ref.index, consumer, slot, (),
                                        same_as=first_read[key]))
                return
            if key is not None:
                first_read[key] = (consumer, slot)
        if steps:
            reshards.append(Reshard(ref.node, ref.index, consumer, slot, tuple(steps)))

    for node in graph:
        if node.kind == "input" and inputs == "global":
            steps = costs.steps(node.output, R, chosen[node.name].outputs[0])
            if steps:
                reshards.append(Reshard(node.name, 0, node.name, INPUT_SLOT, tuple(steps)))
        for slot, ref in enumerate(node.operands):
            add(ref, node.name, slot, chosen[node.name].inputs[slot])
    if graph.outputs.loss is not None:
        add(graph.outputs.loss, OUTPUT, OutputSlot.loss(), R)
    params = graph.params
    for fqn, ref in graph.outputs.grads:
        add(ref, OUTPUT, OutputSlot.grad(fqn), chosen[params[fqn]].outputs[0])
    buffers = {n.target: n.name for n in graph if n.kind == "buffer"}
    for fqn, ref in graph.outputs.buffer_updates:
        add(ref, OUTPUT, OutputSlot.buffer(fqn), chosen[buffers[fqn]].outputs[0])
    for ref in graph.outputs.sends:
        add(ref, OUTPUT, OutputSlot.send(str(ref)), R)

    collectives = []
    comm_time = wire = once_time = 0.0   # once_time: paid once per step, not per micro-batch
    k = method.num_micro_batches      # gradient accumulation: all but the final reductions
    state_once = state_read_once(k, method.auto_sharding_option.rematerialize_parameters)
    for r in reshards:
        if isinstance(r.slot, OutputSlot):
            phase = "backward" if r.slot.kind == "grad" else graph.node(r.producer).phase
            at = graph.node(r.producer)
        else:
            phase = graph.node(r.consumer).phase
            at = graph.node(r.consumer)
        for step in r.steps:
            if step.is_collective:
                collectives.append(Collective(kind=step.kind, axis=step.axis, bytes=step.bytes,
                                              phase=phase, source=at.module, tensor=r.producer,
                                              reduce_op=step.reduce_op, stack=at.stack))
        is_gradient = isinstance(r.slot, OutputSlot) and r.slot.kind == "grad"
        # a forward read of a parameter or buffer: resharded once per step (runtime's
        # param_gather), as a gradient's final resharding is
        once = state_once and isinstance(r.slot, int) and phase == "forward" \
            and graph.node(r.producer).kind in ("param", "buffer")
        times = 1 if is_gradient or once else k
        for step in r.steps:
            if step.is_collective:     # every group along the axis runs this collective
                groups = mesh.num_devices // mesh.shape[step.axis]
                wire += times * groups * wire_bytes(step.kind, mesh.shape[step.axis], step.bytes,
                                                    mesh.backend)
        seconds = (gradient_steps_cost if is_gradient else steps_cost)(mesh, r.steps)
        comm_time += times * seconds
        once_time += seconds if is_gradient or once else 0.0
    # then the all-reduces ops make inside themselves, after every reshard's, so positions of
    # reshard collectives stay as the reshards list them: the statistics of a split softmax
    # dim (phased, max then sum) or a batch-synced op's sums (one pass); never both
    for n in graph.ops():
        s = chosen[n.name]
        phased = sync_steps(s, n.outputs[0], mesh.shape)
        assert not (phased and s.batch_syncs), f"{n.name}: both phased and batch-synced"
        internal = [(st.axis, st.bytes, st.reduce_op) for st in phased] + \
            [(axis, nbytes, "sum") for axis, nbytes in s.batch_syncs]
        for axis, nbytes, reduce_op in internal:
            collectives.append(Collective(kind="all_reduce", axis=axis, bytes=nbytes,
                                          phase=n.phase, source=n.module, tensor=n.name,
                                          reduce_op=reduce_op, stack=n.stack))
            groups = mesh.num_devices // mesh.shape[axis]
            wire += k * groups * wire_bytes("all_reduce", mesh.shape[axis], nbytes, mesh.backend)
        comm_time += k * (steps_cost(mesh, phased) + batch_sync_cost(mesh, s.batch_syncs))
    compute_time = k * sum(compute_cost(
        mesh, n, chosen[n.name].shards, chosen[n.name].outputs, strategy_bytes(
            graph, n, chosen[n.name].inputs, chosen[n.name].outputs, mesh.shape))
        for n in graph.ops())

    leaf_placement = {n.name: chosen[n.name].outputs[0] for n in graph if n.is_leaf}
    state = model_state_bytes(graph, leaf_placement, mesh.shape, method.optimizer_states)
    optimizer_s = optimizer_cost(mesh, {
        n.name: local_bytes(n.output, leaf_placement[n.name], mesh.shape)
        for n in graph if n.kind == "param"}, method.optimizer_states)
    compute_time += optimizer_s
    activations, saved = activation_peak_bytes(
        graph, {k: s.outputs for k, s in chosen.items()}, mesh.shape,
        saved_statistics(graph, mesh), state_at_start=state_once)
    estimates = Estimates(step_time_s=comm_time + compute_time, communication_s=comm_time,
                          once_per_step_s=once_time + optimizer_s,
                          compute_s=compute_time, model_state_bytes_per_device=state,
                          activation_bytes_per_device=activations,
                          saved_activation_bytes_per_device=saved,
                          memory_per_device_bytes=state + activations,
                          wire_bytes_per_step=wire)
    parameters = tuple(ValuePlacement(name=n.target, node=n.name, shape=n.output.shape,
                                      placements=leaf_placement[n.name])
                       for n in graph if n.kind in ("param", "buffer"))
    input_values = tuple(ValuePlacement(name=n.target, node=n.name, shape=n.output.shape,
                                        placements=leaf_placement[n.name])
                         for n in graph if n.kind == "input")
    strategies = tuple(NodeStrategy(node=n.name, inputs=chosen[n.name].inputs,
                                    outputs=chosen[n.name].outputs,
                                    batch_syncs=chosen[n.name].batch_syncs)
                       for n in graph.ops())
    notes = list(space.notes)
    for n in graph:
        if n.kind == "input" and n.output.shape and n.output.shape[0] % mesh.num_devices:
            notes.append(f"{n.target}: batch dim {n.output.shape[0]} does not divide by "
                         f"{mesh.num_devices} devices, so it cannot be fully data-parallel")
    per_block = sorted(n for n in space.random
                       if any(is_shard(p) for p in chosen[n].outputs[0]))
    if per_block:
        notes.append(f"{len(per_block)} random ops (dropout masks...) are drawn per block: "
                     "the distribution one device draws, not its numbers; "
                     "AutoShardingOption(random='replicated') draws them whole")
    explanations = _explain_parameters(graph, mesh, method, chosen, costs, space)
    return Plan(
        explanations=explanations,
        mesh_shape=mesh.shape, axis_names=mesh.axis_names, parameters=parameters,
        inputs=input_values, strategies=strategies, reshards=tuple(reshards),
        collectives=tuple(collectives), estimates=estimates,
        unsupported_ops=tuple(space.unsupported),
        stages=(MeshStage(layers=(0,), logical_shape=tuple(mesh.shape),
                          num_devices=mesh.num_devices),),
        method=method.to_dict(), graph_fingerprint=graph.fingerprint(), notes=tuple(notes))
