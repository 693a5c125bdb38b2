"""The intra-op pass: OpGraph + logical mesh + options -> Plan.

1. strategies for every node from its rule (replicate-only for ops without one);
2. costs: compute per strategy, resharding per edge (the redistribution planner priced
   by the alpha-beta model), the loss gathered whole on every device, each gradient
   brought to its parameter's layout;
3. the ILP picks one strategy per node;
4. the choice becomes a Plan: placements, every resharding step, the collectives they
   issue, and estimates of step time and memory (``passes/sharding/sharding_plan.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import time
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.collector import collector_paused
from torchalpa.core.opgraph import OpGraph, TensorSpec
from torchalpa.core.options import AutoShardingOption, ShardParallel
from torchalpa.core.placement import Shard
from torchalpa.core.plan import (
    Plan,
    state_read_once,
)
from torchalpa.core.units import format_bytes
from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
from torchalpa.passes.pricing.attention_price import saved_statistics
from torchalpa.passes.pricing.fused_pricing import priced_as
from torchalpa.passes.pricing.inplace_pricing import priced_in_place
from torchalpa.passes.pricing.memory import (
    MemoryModel,
    gradients_from_backward,
    model_state_bytes,
    same_layout_views,
)
from torchalpa.passes.pricing.step_end import device_type_of
from torchalpa.passes.rules import rule_for
from torchalpa.passes.sharding.constraints import apply_constraints
from torchalpa.passes.sharding.costgraph import (
    REGATHER_SAVED_VIEWS,
    RESLICE_REDUCTION,
    SLICE_PARTIAL,
    CostGraph,
    ReshardCosts,
    solve_sharing_reads,
)
from torchalpa.passes.sharding.gradient_scatter import scatter_gradients
from torchalpa.passes.sharding.ilp import (
    CLOCK_NOTE,
    ILPProblem,
    ILPSolution,
    InfeasibleError,
    MemoryNotSettled,
    OverMemoryBudget,
    SolverStopped,
    clock_watch,
    solve_ilp,
)
from torchalpa.passes.sharding.plan_start import start_choice
from torchalpa.passes.sharding.reshard import local_bytes, plan_reshard
from torchalpa.passes.sharding.sharding_plan import (
    assemble_plan,
    merge_gradient_all_reduces,
    replace_estimates,
)
from torchalpa.passes.sharding.shared_reshard import multi_read_values
from torchalpa.passes.sharding.simplify import Grouping, group_nodes
from torchalpa.passes.sharding.stage_boundary import boundary_layout
from torchalpa.passes.sharding.strategies import (
    Strategy,
    StrategySpace,
    replicate_only,
    splits_over_both_axes,
)
from torchalpa.passes.sharding.strides import strided_regions

__all__ = ["plan_intra_op", "step_time_lower_bound", "UnsupportedOpWarning", "build_strategies",
           "NoPlanWithinBudget", "least_memory_unsaid", "least_memory_said", "memory_floor",
           "FIT_TOLERANCE", "planned_for", "intra_op_problem", "sharing_key"]

log = logging.getLogger("torchalpa.planner")


class UnsupportedOpWarning(UserWarning):
    """An op has no sharding rule and runs replicated."""


_PER_GRAPH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""graph -> what ``build_strategies`` reads of it alone, whatever the mesh (its strided
regions, each node's rule: the node and its operands' specs decide it), made once for
the views of one graph."""


def build_strategies(graph: OpGraph, mesh: LogicalMesh, inputs: str = "global",
                     option: AutoShardingOption | None = None,
                     memo: PricingMemo | None = None) -> StrategySpace:
    """Every node's candidate strategies; ops without a rule get replicate-only.
    ``memo``: where rules' strategies and reachable layouts are kept across solves."""
    memo = PricingMemo() if memo is None else memo
    strategies: dict[str, list[Strategy]] = {}
    unsupported: list[dict] = []
    heavy, random = set(), set()
    per_graph = _PER_GRAPH.get(graph)
    if per_graph is None:
        per_graph = _PER_GRAPH[graph] = {"regions": strided_regions(graph), "rules": {}}
    regions, rules = per_graph["regions"], per_graph["rules"]
    for node in graph:
        strides = regions.get(node.name, ())
        if node.is_leaf:
            options = list(memo.leaf_strategies(node.output, mesh, strides))
            if node.kind == "input" and node.batched and inputs == "local":
                options = [_batch_sharded(node.output, mesh)]
            crossing = boundary_layout(graph, node.name, node.output, mesh)
            if node.kind == "input" and crossing is not None:   # received batch-split
                options = [Strategy(inputs=(), outputs=(crossing,))]
            strategies[node.name] = options
            continue
        known = rules.get(node.name)
        if known is None or known[0] is not node:
            known = rules[node.name] = (node, rule_for(node, graph))
        rule = known[1]
        if rule is not None and rule.random:
            random.add(node.name)
            if option is not None and option.random == "replicated":
                rule = replace(rule, blocked=frozenset(rule.factors()))   # drawn whole
        if rule is not None and rule.heavy:
            heavy.add(node.name)
        options = []
        if rule is not None:
            options = list(memo.rule_strategies(
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
    _prune_unreachable(graph, strategies, mesh, memo.reachable(mesh.shape))
    for item in unsupported:
        warnings.warn(f"no sharding rule for {item['op']} (node {item['node']}"
                      + (f", module '{item['module']}'" if item["module"] else "")
                      + (f", at {item['stack']}" if item["stack"] else "")
                      + "): it runs replicated on every device", UnsupportedOpWarning,
                      stacklevel=3)
    return StrategySpace(strategies, unsupported, notes, frozenset(heavy), frozenset(random))


def _prune_unreachable(graph: OpGraph, strategies: dict[str, list[Strategy]],
                       mesh: LogicalMesh, shared: dict) -> None:
    """Drop strategies that read an operand in a layout no producer strategy can be
    resharded into (e.g. a Partial input downstream of ops that never make one). The
    answers depend on the tensor, the layouts and the mesh's shape only: kept in
    ``shared`` ((spec, sources) -> {want: reachable?}, ``PricingMemo.reachable``)."""
    by_operand: dict = {}    # (producer, output index) -> (spec, its layouts, that dict)
    # (the producer's strategies by identity, output index) -> (them, their layouts):
    # alike nodes hold the rules' shared strategies, whose layouts are hashed once
    # (placements hash in Python); kept across graphs and views of this mesh shape, so
    # each set of layouts is one object and the answers' keys compare it by identity
    # (the strategies are held with it: their identities stay theirs)
    layouts: dict = shared.setdefault("operand layouts", {})
    if len(layouts) > 50_000:
        layouts.clear()

    def operand(ref) -> tuple:
        entry = by_operand.get((ref.node, ref.index))
        if entry is None:
            spec = graph.spec(ref)
            made = strategies[ref.node]
            key = (tuple(map(id, made)), ref.index)
            found = layouts.get(key)
            if found is None:
                found = layouts[key] = (tuple(made),
                                        frozenset(p.outputs[ref.index] for p in made))
            sources = found[1]
            entry = by_operand[(ref.node, ref.index)] = (
                spec, sources, shared.setdefault((spec, sources), {}))
        return entry

    def reachable(ref, want) -> bool:
        spec, sources, answers = operand(ref)
        answer = answers.get(want)
        if answer is None:
            answer = answers[want] = any(plan_reshard(spec, src, want, mesh.shape) is not None
                                         for src in sources)
        return answer

    # nodes alike (a transformer's identical layers) ask the same questions: the same
    # strategies (the rules' shared objects) of operands with the same answers dicts
    alike = shared.setdefault("alike nodes", {})
    if len(alike) > 50_000:
        alike.clear()
    for node in graph.ops():
        options = strategies[node.name]
        answers = tuple(operand(ref)[2] for ref in node.operands)
        key = (tuple(map(id, options)), tuple(map(id, answers)))
        found = alike.get(key)
        if found is None:
            keep = [s for s in options
                    if all(s.inputs[k] is None or reachable(ref, s.inputs[k])
                           for k, ref in enumerate(node.operands))]
            # the strategies and answers are kept with it: their identities stay theirs
            found = alike[key] = (tuple(options), answers, keep)
        if found[2]:
            strategies[node.name] = list(found[2])


def _batch_sharded(spec: TensorSpec, mesh: LogicalMesh) -> Strategy:
    """``inputs='local'``: each device already holds its slice of the batch (dim 0)."""
    if spec.shape and spec.shape[0] % mesh.num_devices:
        raise ValueError(f"inputs='local' needs the batch dim ({spec.shape[0]}) divisible by "
                         f"the {mesh.num_devices} devices")
    return Strategy(inputs=(), outputs=(tuple(Shard(0) for _ in mesh.shape),))


def plan_intra_op(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel | None = None, *,
                  inputs: str = "global", blocks: dict[str, tuple[str, int]] | None = None,
                  in_flight: int = 1, memo: PricingMemo | None = None,
                  deadline: float | None = None, step_micro_batches: int = 1,
                  sharing: dict | None = None, start_from: Plan | None = None) -> Plan:
    """Solve Alpa's intra-op ILP for ``graph`` on ``mesh`` and return the Plan.

    ``blocks`` (node -> (block kind, index)) lets identical layers share one decision.
    ``in_flight``: micro-batches whose activations must fit in memory at once (a pipeline
    stage's; the estimates still describe one micro-batch). ``memo``: pricing work kept
    across the solves of whoever passes it (``passes/pipeline_search/pricing_memo.py``; default: this
    solve's own). ``deadline`` (a ``time.perf_counter()`` value): each solver run gets only
    the time left before it, at least ``MIN_SOLVE_S`` (the solver's best plan by then).
    ``step_micro_batches``: a pipeline stage's (``method`` has one micro-batch): the step
    runs the graph this many times and reduces the summed gradients once, after the last
    backward (``runtime/execution/step.py``), so the ILP weighs what a micro-batch does
    that many times against the gradients' final resharding, once (a gradient is then
    reduced inside backward only where that is cheaper over the whole step); a stage's
    forward reads of parameters are resharded once per step too, before its first
    micro-batch, as its runtime gathers them (``plan.state_read_once``: not under
    ``rematerialize_parameters``). The estimates still describe one micro-batch and what
    is paid once per step. ``sharing``: values earlier solves of alike graphs on this view
    found read twice in one layout (``sharing_key`` -> values; AutoParallel's candidates):
    priced once per layout from the first solve, and what this solve found is added.
    ``start_from``: a plan of this graph on this view found before (at a wider gap): the first
    solve starts from its strategies (``plan_start.py``; optimal to the same gap).
    """
    method = method or ShardParallel()
    if step_micro_batches < 1 or (step_micro_batches > 1 and method.num_micro_batches > 1):
        raise ValueError(f"step_micro_batches={step_micro_batches} is a pipeline stage's "
                         f"micro-batch count, for a method of one micro-batch "
                         f"(num_micro_batches={method.num_micro_batches}); give one of them")
    start = time.perf_counter()
    option, mesh, graph, space, costs = intra_op_problem(graph, mesh, method, inputs, memo)
    if option.force_simple_heuristic or not option.enable_auto_sharding:
        chosen = _propagate(graph, space.strategies, costs, mesh,
                            by_size=option.force_simple_heuristic == "shard-largest")
        plan = merge_gradient_all_reduces(
            assemble_plan(graph, mesh, method, chosen, costs, space, inputs,
                          step_micro_batches), graph, mesh, option)
        return replace_estimates(plan, objective=plan.estimates.step_time_s,
                                 solve_seconds=time.perf_counter() - start)
    ilp = _IntraOpILP(graph, mesh, method, option, space, costs, blocks, in_flight, deadline,
                      max(step_micro_batches, method.num_micro_batches))
    key = sharing_key(mesh)
    if sharing is not None and key in sharing:
        ilp.seed = _sharing_seed(graph, sharing[key], option)
    if start_from is not None:
        ilp.start = start_choice(start_from, space.strategies)
    built = time.perf_counter()
    with clock_watch() as stops:
        try:
            best = ilp.best()
        except NoPlanWithinBudget as e:   # a plain error: it may cross to another process
            raise (e.explained() if _LEAST_MEMORY.get() else OverMemoryBudget(str(e))) from None
    if sharing is not None:
        sharing[key] = sharing.get(key, frozenset()) | best.shared
    chosen = best.chosen
    if option.prefer_reduce_scatter:    # Alpa's rewrite after its ILP
        chosen, costs = scatter_gradients(graph, mesh, space.strategies, chosen, costs,
                                          option.pin)
    plan = merge_gradient_all_reduces(assemble_plan(graph, mesh, method, chosen, costs,
                                                    space, inputs, step_micro_batches),
                                      graph, mesh, option)
    plan = _with_solve_figures(plan, graph, mesh, space, best, ilp.budget, start, built)
    if stops:
        plan = replace(plan, notes=plan.notes + (
            f"{CLOCK_NOTE} {len(stops)} of this plan's solver runs (at {max(stops):.0f} s): "
            "a faster or idler machine may find a better plan; not cached",))
    return plan


FIT_TOLERANCE = 1e-9
"""How far (relative) a plan's peak may be above the memory budget and still fit: the
peak is a sum of floats in another order than the rows the ILP held it to."""

MIN_SOLVE_S = 10.0
"""The least time a solver run is given when a deadline cuts its limit."""

_LEAST_MEMORY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torchalpa_least_memory", default=True)


@contextlib.contextmanager
def least_memory_unsaid() -> Iterator[None]:
    """Within the block, ``plan_intra_op`` on a view whose ILP has no plan within the memory
    budget raises a plain ``InfeasibleError`` without the least memory a plan of it needs
    ("no plan of its ILP fits"). That figure takes up to 20 ILPs minimizing the peak
    (``_minimum_memory``), which near the budget cost more than the ILP that failed
    (LLaMA-3-8B, remat full:2, 2 micro-batches, 8 H100, 4 x 2: 63.8 s of CPU against 6.9),
    for a caller that keeps only that the view does not fit: AutoParallel's search, whose
    notes keep the first line of a candidate's error. A forked worker inherits it (a
    context variable)."""
    token = _LEAST_MEMORY.set(False)
    try:
        yield
    finally:
        _LEAST_MEMORY.reset(token)


def least_memory_said() -> bool:
    """False within ``least_memory_unsaid``: the caller keeps only that a view does not
    fit, so nothing more about it (its least memory, what would fit) is worth working out."""
    return _LEAST_MEMORY.get()


class NoPlanWithinBudget(OverMemoryBudget):
    """No plan of a view's ILP fits its memory budget. The least memory a plan needs is
    computed only when asked (``explained``): where a less simplified ILP is solved next,
    or the caller keeps only that the view does not fit (``least_memory_unsaid``), it is
    never needed."""

    def __init__(self, budget: float, mesh: LogicalMesh, least: Callable[[], float]):
        super().__init__(_does_not_fit(budget, mesh, None))
        self.budget, self.mesh, self.least = budget, mesh, least

    def explained(self) -> OverMemoryBudget:
        """The error with the least memory a plan needs (its ILPs solved now)."""
        return OverMemoryBudget(_does_not_fit(self.budget, self.mesh, self.least()))


def _does_not_fit(budget: float, mesh: LogicalMesh, need: float | None) -> str:
    """Why a view has no plan: its budget, and the least memory a plan needs if known."""
    least = "no plan of its ILP fits" if need is None else \
        f"it needs at least {format_bytes(need)} per device"
    return (f"the model does not fit in {format_bytes(budget)} per device on a "
            f"{_describe(mesh)}: {least} (parameters, gradients, optimizer states and "
            "activations); use more devices, a smaller batch, or a larger "
            "memory_budget_per_device")


def sharing_key(mesh: LogicalMesh) -> tuple:
    """What values found read twice alike carry over between: solves on one view (the
    layouts are the mesh's)."""
    return tuple(mesh.shape), tuple(mesh.axis_names or ())


def _sharing_seed(graph: OpGraph, found: frozenset, option: AutoShardingOption) -> frozenset:
    """The values of ``found`` that ``graph`` reads twice or more, less parameters and
    buffers where they are gathered again in backward (their reads share no copy then,
    ``shared_reshard.read_key``)."""
    seed = found & multi_read_values(graph)
    if option.rematerialize_parameters:
        seed = frozenset(v for v in seed if graph.node(v[0]).kind not in ("param", "buffer"))
    return seed


class _Solved(NamedTuple):
    """One solve of the ILP: the grouping and cost graph it was built on, the solution,
    each node's strategy, and the values priced once per layout."""

    grouping: Grouping
    cg: CostGraph
    solution: ILPSolution
    chosen: dict[str, Strategy]
    shared: frozenset


class _IntraOpILP:
    """The ILP of ``graph`` on ``mesh``, solved as simplified as its size allows and
    re-solved less simplified from the plan found where that may pay (``best``)."""

    def __init__(self, graph: OpGraph, mesh: LogicalMesh, method: ShardParallel,
                 option: AutoShardingOption, space: StrategySpace, costs: ReshardCosts,
                 blocks: dict[str, tuple[str, int]] | None, in_flight: int,
                 deadline: float | None = None, repeats: int = 1):
        self.graph, self.mesh, self.method, self.option = graph, mesh, method, option
        self.deadline = deadline
        self.repeats = repeats      # micro-batches per gradient reduction
        self.space, self.costs, self.blocks, self.in_flight = space, costs, blocks, in_flight
        self.seed: frozenset = frozenset()  # values priced once per layout from the start
        self.start: dict[str, Strategy] | None = None   # the first solve's starting plan
        self.budget = option.memory_budget_per_device or mesh.memory_per_device
        # a parameter's forward reshards run once per step (runtime/rewrites/param_gather.py),
        # in a pipeline stage too (its step runs ``repeats`` micro-batches)
        self.state_once = state_read_once(repeats, option.rematerialize_parameters)
        self.grads_late = gradients_from_backward(repeats, method.optimizer_states)
        if self.state_once and self.budget:
            # a parameter sent whole to another stage (a tied weight) is then gathered
            # once per step and its copy held for the step: what the plan has left
            self.budget -= sum(graph.spec(ref).nbytes for ref in graph.outputs.sends
                               if graph.node(ref.node).kind == "param")

    def best(self) -> _Solved:
        """The best plan of the solves the graph's size calls for (see the comments)."""
        graph, option, blocks = self.graph, self.option, self.blocks
        found = None
        frees = self._frees_followers()
        # a follower takes its operand's layout; deciding on its own it may avoid a
        # reshard the merge forces (GPT's stages: the gain of the unsimplified re-solve)
        if frees and len(graph) > option.exact_below:
            # its problem contains the simplified one, so it is solved instead of it: on
            # GPT-39B's memory-bound stages solving the simplified ILP first and this one
            # from its plan took 1.2-4x as long, for a plan no better
            try:
                found = self.solve(1, followers=False, start=self.start)
            except SolverStopped as e:
                log.warning("the ILP with free followers found no plan in time (%s); solving "
                            "the simplified one", e)
        best = found if found is not None else self._solve_merged_or_free()
        if frees and found is None and len(graph) <= option.exact_below:
            # re-solved unsimplified below: from the freed plan that solve is much shorter
            # (pipeline_vs_3d's pp4 dp4 tp4 grid, 4-layer GPT-39B stages: planned in
            # 23.3 s, 128.7 s from the simplified plan), and plans that tie stay the
            # simplified ILP's (Alpa's tests pin such tie-breaks)
            best = self.resolve(best, "free followers", followers=False)
        exact_next = len(graph) <= option.exact_below and len(best.cg.node_costs) < len(graph)
        # the unsimplified problem contains the alternating one (and starts from this
        # plan): where it is solved next, the alternating solve would only repeat its work
        if not exact_next and blocks and option.alternate_blocks and _reshards_between_blocks(
                graph, blocks, best.chosen, self.costs) > 0.01 * best.solution.objective:
            # shared layers cannot alternate; let every other layer decide apart, keep the
            # best
            alternative = self.solve(2, start=best.chosen, shared=best.shared)
            if alternative.solution.objective < best.solution.objective:
                best = alternative
        if exact_next:
            # shared decisions and followers restrict the problem; on a graph this small,
            # solve the full problem too (from the plan found) so they never cost optimality
            best = self.resolve(best, "nothing simplified", exact=True)
        return best

    def _solve_merged_or_free(self) -> _Solved:
        """The simplified solve; where no plan of it fits the budget, the one with free
        followers (a follower takes its operand's layout: a gradient's cast cannot split
        the sum its matmul leaves partial, which a step summing micro-batches may need to
        fit; MPT-13B on 8 A100 under FSDP); where its plan fits near the budget
        (``_near_budget``), that one re-solved with free followers from it, the better
        kept."""
        try:
            simplified = self.solve(1, start=self.start)
        except SolverStopped:   # the clock, not the budget: a retry would depend on load
            raise
        except InfeasibleError:
            # the least memory of this problem is not said: the free followers' is
            if not self._followers_decide_more():
                raise
            log.info("no plan of the simplified ILP fits the budget: solving with free "
                     "followers")
            return self.solve(1, followers=False, start=self.start)
        if self._near_budget(simplified):
            # the merge binds most where memory does: a follower deciding on its own can
            # keep a smaller layout than its operand's (target a's plan, LLaMA-3-8B on
            # 1 x 8: est 2.632 s/step at 76.2 of 77.3 GiB merged, 2.590 at 64.3 freed)
            return self.resolve(simplified, "free followers near the budget",
                                followers=False)
        return simplified

    def _near_budget(self, solved: _Solved) -> bool:
        """Whether ``solved`` (a plan of a graph above ``free_followers_below``) peaks at
        ``free_followers_near_budget`` of the budget or above, with followers that could
        decide on their own."""
        fraction = self.option.free_followers_near_budget
        if not fraction or not self.budget or len(self.graph) <= self.option.free_followers_below:
            return False
        peak, _ = _peak(self.graph, self.memory_model(solved.grouping), solved.chosen,
                        self.mesh, self.method.optimizer_states)
        if peak < fraction * self.budget or not self._followers_decide_more():
            return False
        # counted by tests and benchmarks (the re-solve's cost is where it fires)
        log.info("near the budget: the simplified plan peaks at %s of %s (%.1f %%); "
                 "re-solving with free followers", format_bytes(peak),
                 format_bytes(self.budget), 100 * peak / self.budget)
        return True

    def timed_option(self) -> AutoShardingOption:
        """The option with the solver's time limit cut to what is left before the
        deadline (at least ``MIN_SOLVE_S``)."""
        option = self.option
        if self.deadline is None:
            return option
        left = max(MIN_SOLVE_S, self.deadline - time.perf_counter())
        if option.time_limit is not None and left >= option.time_limit:
            return option
        return replace(option, time_limit=left)

    def _frees_followers(self) -> bool:
        """Whether letting followers decide on their own gives the ILP more decisions, on
        a graph small enough for it (``free_followers_below``)."""
        return len(self.graph) <= self.option.free_followers_below and \
            self._followers_decide_more()

    def _followers_decide_more(self) -> bool:
        """Whether letting followers decide on their own gives the ILP more decisions."""
        graph, S, blocks, heavy = self.graph, self.space.strategies, self.blocks, \
            self.space.heavy
        return len(group_nodes(graph, S, blocks, heavy=heavy, merge_followers=False)
                   .representatives) > len(group_nodes(graph, S, blocks, heavy=heavy)
                                           .representatives)

    def solve(self, period: int, start: dict[str, Strategy] | None = None,
              exact: bool = False, shared: frozenset = frozenset(),
              followers: bool = True) -> _Solved:
        """One solve: ``period`` 2 lets every other repeated block decide apart,
        ``exact`` shares no decision at all, ``followers`` False lets followers decide on
        their own; ``start``: a plan of a coarser grouping to start from."""
        graph, S, mesh = self.graph, self.space.strategies, self.mesh
        shared = shared | self.seed
        grouping = group_nodes(graph, S, None if exact else self.blocks, heavy=self.space.heavy,
                               period=period, merge_followers=followers and not exact)
        memory = self.memory_model(grouping)
        cg, solution, chosen, shared = solve_sharing_reads(
            graph, mesh, S, grouping, self.costs,
            lambda cg, initial: _solve_within_memory(graph, S, grouping, cg, memory,
                                                     self.budget, self.timed_option(), mesh,
                                                     initial=initial),
            _initial_choice(S, grouping, start), shared,
            micro_batches=self.repeats, state_once=self.state_once,
            share_state=not self.option.rematerialize_parameters)
        return _Solved(grouping, cg, solution, chosen, shared)

    def memory_model(self, grouping: Grouping) -> MemoryModel:
        """The memory rows and timeline of this ILP's plans on ``grouping``."""
        graph, mesh = self.graph, self.mesh
        return MemoryModel(graph, self.space.strategies, grouping, mesh.shape,
                           self.method.optimizer_states, self.in_flight,
                           saved_statistics(graph, mesh), state_at_start=self.state_once,
                           steps_of=None if self.option.rematerialize_parameters
                           else self.costs.steps, grads_from_backward=self.grads_late,
                           optimizer=self.method.optimizer,
                           device_type=device_type_of(mesh.backend),
                           bucket_bytes=mesh.gradient_bucket_bytes)

    def resolve(self, best: _Solved, what: str, **less_simplified) -> _Solved:
        """Solve again, from ``best``'s plan, with ``less_simplified`` letting more nodes
        decide apart; the better of the two plans."""
        try:
            found = self.solve(1, start=best.chosen, shared=best.shared, **less_simplified)
        except InfeasibleError as e:    # a time limit without a solution: keep what we have
            log.warning("the ILP with %s found no plan (%s); keeping the plan found, which "
                        "may not be optimal", what, e)
            return best
        if found.solution.objective < best.solution.objective * (1 - 1e-9):
            log.info("the ILP with %s improved the plan: %.6g -> %.6g", what,
                     best.solution.objective, found.solution.objective)
            return found
        return best


def _initial_choice(S: dict[str, list[Strategy]], grouping: Grouping,
                    start: dict[str, Strategy] | None) -> dict[str, int] | None:
    """``start`` (a plan of a coarser grouping, feasible here too, or of this problem found
    before: ``plan_start.py``) as a starting choice per representative of ``grouping``;
    representatives it gives no strategy of theirs are left to the solver."""
    if start is None:
        return None
    initial = {}
    for k in grouping.representatives:
        position = {id(S[k][i]): a for a, i in enumerate(grouping.index[k])}
        if k in start and id(start[k]) in position:
            initial[k] = position[id(start[k])]
    return initial


def _with_solve_figures(plan: Plan, graph: OpGraph, mesh: LogicalMesh, space: StrategySpace,
                        best: _Solved, budget: float | None, start: float,
                        built: float) -> Plan:
    """``plan`` with the solve's figures in its estimates, and a note naming what it was
    planned for."""
    cg, solution = best.cg, best.solution
    seconds = time.perf_counter() - start
    num_strategies = sum(len(v) for v in space.strategies.values())
    log.info("intra-op plan on mesh %s: %d nodes (%d decide), %d strategies, %d/%d edges "
             "priced, ILP %d vars, solved in %.2fs (build %.2fs), objective %.6g",
             mesh.shape, len(graph), len(cg.node_costs), num_strategies, cg.num_priced,
             cg.num_edges, solution.num_variables, solution.seconds, built - start,
             solution.objective)
    plan = replace_estimates(
        plan, objective=solution.objective, solve_seconds=seconds,
        ilp_seconds=solution.seconds, ilp_variables=solution.num_variables,
        num_strategies=num_strategies, num_decisions=len(cg.node_costs),
        flops_per_step=float(sum(node.flops for node in graph)),
        # with flops_per_step: the MFU of a measured step
        peak_flops_per_device=None if mesh.peak_flops is None else float(mesh.peak_flops),
        memory_budget_bytes=float(budget) if budget else None)
    target = planned_for(mesh, budget)
    return replace(plan, notes=plan.notes + (target,)) if target else plan


def intra_op_problem(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel, inputs: str,
                     memo: PricingMemo | None = None):
    """What the ILP is built from: the option in effect (pins of a manual option added),
    the mesh as priced (gradients in the runtime's buckets), the graph as priced, every
    node's strategies and the resharding costs (kept in ``memo`` across solves)."""
    memo = PricingMemo() if memo is None else memo
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
    space = build_strategies(graph, mesh, inputs, option, memo)
    costs = memo.reshard_costs(mesh, option.allow_reduce_scatter, forbidden_collectives(option))
    return option, mesh, graph, space, costs


def step_time_lower_bound(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel | None = None,
                          *, inputs: str = "global", memo: PricingMemo | None = None,
                          blocks: dict[str, tuple[str, int]] | None = None,
                          step_micro_batches: int = 1) -> float | None:
    """Seconds that no plan ``plan_intra_op`` could return for ``graph`` on ``mesh`` has an
    estimated step below: the linear relaxation of the least simplified problem it may
    solve (``_finest_grouping``: without ``blocks``, or on a graph it solves unsimplified,
    every node deciding on its own; the other problems, the memory constraints and the
    every-other-layer alternative only restrict it), with every value read twice priced
    at ``1/k`` of each of its ``k`` reads (however many share one resharded copy, the
    dearest read is paid, and it is at least their mean). An LP of a second or two where the
    ILP it bounds may run for minutes: ``plan_graph`` skips a logical mesh whose bound is
    above a plan it already has. ``blocks``: those ``plan_intra_op`` is given -- with them
    the LP shares decisions as its problems do, a fraction of the size (LLaMA-3-8B's step
    on 8 H100: 2.3 s of CPU against 46 s unsimplified, the same bound).

    None where there is no such bound: no ILP (the heuristics), no HiGHS, or a plan whose
    estimated step the all-reduce combiner lowers after the solve (Alpa's accounting on a
    hand-built mesh, where the step is below the objective). ``memo``: as in
    ``plan_intra_op``. ``step_micro_batches``: a pipeline stage's, as in ``plan_intra_op``:
    the bound is then on the ILP's objective, which weighs a micro-batch's work that many
    times against what is paid once per step (``stage_solve.stage_time_lower_bound`` turns
    it into seconds per micro-batch). Built and solved with the garbage collector paused
    (``collector_paused``): the same LP, a tenth less CPU."""
    from torchalpa.passes.sharding.costgraph import build_cost_graph
    from torchalpa.passes.sharding.ilp import lower_bound
    with collector_paused():      # millions of objects freed by counting alone
        method = method or ShardParallel()
        option, mesh, graph, space, costs = intra_op_problem(graph, mesh, method, inputs, memo)
        if option.force_simple_heuristic or not option.enable_auto_sharding:
            return None
        if option.all_reduce_threshold and mesh.gradient_bucket_bytes <= 0:
            return None                 # merge_gradient_all_reduces may subtract latencies
        S = space.strategies
        grouping = _finest_grouping(graph, space, option, blocks)
        repeats = max(step_micro_batches, method.num_micro_batches)
        reads: dict[tuple[str, int], int] = defaultdict(int)
        for node in graph.ops():
            for ref in node.operands:
                reads[(ref.node, ref.index)] += 1
        cg = build_cost_graph(graph, mesh, S, grouping, costs, read_weights={
            v: 1.0 / k for v, k in reads.items()
            if k > 1 and (graph.node(v[0]).kind not in ("param", "buffer")
                          or not option.rematerialize_parameters)},
            micro_batches=repeats, state_once=state_read_once(repeats,
                                                             option.rematerialize_parameters))
        return lower_bound(ILPProblem(node_costs=cg.node_costs, edges=cg.edges))


def memory_floor(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel | None = None, *,
                 inputs: str = "global", in_flight: int = 1, memo: PricingMemo | None = None,
                 step_micro_batches: int = 1) -> tuple[float, float | None]:
    """(bytes, budget): bytes per device that every plan ``plan_intra_op`` could return
    for these arguments holds at some point of its step, and the budget (None: none) its
    memory rounds hold a plan's peak to (``_solve_within_memory``). Where ``bytes`` is
    above the budget (``FIT_TOLERANCE``) no plan fits, and every solve of it would end
    infeasible or without settling memory: a proof from one pass over the step's
    liveness, without an ILP.

    Sound: a plan is returned only where its timeline's peak is within the budget, and
    ``MemoryModel.lower_timeline`` is below that timeline at every point for every plan of
    the least simplified grouping any solve uses (``_finest_grouping`` without blocks:
    every other grouping merges its nodes further, so its plans are plans of it); a
    method that only restricts strategies (``parameters="sharded"``) only raises each
    term's least. The heuristics (no ILP) check no budget: (0, None)."""
    method = method or ShardParallel()
    option, mesh, graph, space, costs = intra_op_problem(graph, mesh, method, inputs, memo)
    if option.force_simple_heuristic or not option.enable_auto_sharding:
        return 0.0, None
    ilp = _IntraOpILP(graph, mesh, method, option, space, costs, None, in_flight,
                      repeats=max(step_micro_batches, method.num_micro_batches))
    if not ilp.budget:
        return 0.0, None
    floor = ilp.memory_model(_finest_grouping(graph, space, option, None)).lower_timeline()
    return float(floor.max(initial=0.0)), float(ilp.budget)


def _finest_grouping(graph: OpGraph, space: StrategySpace, option: AutoShardingOption,
                     blocks: dict[str, tuple[str, int]] | None) -> Grouping:
    """The grouping every problem ``_IntraOpILP.best`` may solve with ``blocks`` refines:
    nothing shared where it may solve the unsimplified problem (``exact_below``), else
    free followers and every other repeated block deciding apart (``alternate_blocks``;
    the shared and merged groupings' plans are plans of it too)."""
    if not blocks or len(graph) <= option.exact_below:
        blocks = None
    return group_nodes(graph, space.strategies, blocks, heavy=space.heavy,
                       period=2 if option.alternate_blocks else 1, merge_followers=False)


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
    ``LogicalDeviceMesh.flatten``), the batch split over it, no all-gather, no all-to-all.
    ``elementwise="fused"`` prices elementwise kernels as fused ones (``eager_kernels``)."""
    if option.force_data_parallel:
        if mesh.ndim > 1:
            assert mesh.alpha is not None and mesh.beta is not None  # __post_init__ fills them
            mesh = replace(mesh, shape=(mesh.num_devices,), alpha=(max(mesh.alpha),),
                           beta=(min(mesh.beta),), axis_names=None)
        option = replace(option, force_batch_dim_to_mesh_dim=-1, allow_all_gather=False,
                         allow_all_to_all=False)
    if option.elementwise == "fused" and mesh.eager_kernels:   # fused kernels: full bandwidth
        mesh = replace(mesh, eager_kernels=False)
    if not option.enable_auto_sharding:   # whole unless pinned, and whole work allowed
        option = replace(option, allow_recompute_heavy_op=True, parameters=(
            "replicated" if option.parameters == "auto" and option.allow_replicated_parameters
            else option.parameters))
    return option, mesh


def forbidden_collectives(option: AutoShardingOption) -> frozenset:
    """Collective kinds resharding may not use under ``option``, and (without
    ``slice_before_reduce``) the local steps ``ReshardCosts`` forbids: ``SLICE_PARTIAL``,
    ``RESLICE_REDUCTION``; with ``sequence_parallel`` (Megatron's, which gathers a norm's
    output again in backward) ``REGATHER_SAVED_VIEWS``."""
    return frozenset(k for k, allowed in (("all_gather", option.allow_all_gather),
                                          ("all_to_all", option.allow_all_to_all),
                                          (SLICE_PARTIAL, option.slice_before_reduce),
                                          (RESLICE_REDUCTION, option.slice_before_reduce),
                                          (REGATHER_SAVED_VIEWS, not option.sequence_parallel))
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
                                      if graph.node(k).is_leaf}, mesh.shape, optimizer_states,
                              memory.grads_from_backward, {k: s.outputs for k, s in chosen.items()})
    leaves = {k: s.outputs[0] for k, s in chosen.items() if graph.node(k).is_leaf}
    inputs = {k: s.inputs for k, s in chosen.items()}
    return memory.timeline({k: s.outputs for k, s in chosen.items()}, state,
                           memory.kept_copies(chosen), same_layout_views(graph, leaves, inputs),
                           inputs)


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


def _solve_within_memory(graph: OpGraph, S: dict[str, list[Strategy]], grouping: Grouping,
                         cg: CostGraph, memory: MemoryModel, budget: float | None,
                         option: AutoShardingOption, mesh: LogicalMesh, max_rounds: int = 20,
                         initial: dict[str, int] | None = None
                         ) -> tuple[ILPSolution, dict[str, Strategy]]:
    """Solve; while the plan's true peak exceeds the budget, constrain memory there too."""
    problem = ILPProblem(node_costs=cg.node_costs, edges=cg.edges, shared=cg.shared)
    if budget is None:
        solution = _solve(problem, option, initial)
        return solution, _expand(graph, S, grouping, solution.choice)
    states = memory.optimizer_states
    points: list[int] = []
    worst = memory.upper_timeline()
    if worst.max(initial=0) > budget:
        # the budget may bind: from the first solve on, constrain the likely peaks and
        # points spread over where memory could exceed it (constraints an optimal plan
        # meets anyway; they spare the solver regions a later round would cut off)
        points = sorted(set(memory.likely_peaks()) | set(_violations(worst, budget)))
        problem = replace(problem, **_memory_rows(memory, points), memory_budget=budget)
    for _ in range(max_rounds):
        try:
            solution = _solve(problem, option, initial)
        except SolverStopped:
            raise
        except InfeasibleError:
            if not points:
                raise
            at = list(points)
            raise NoPlanWithinBudget(budget, mesh, lambda: _minimum_memory(
                graph, S, grouping, cg, memory, at, option, mesh, states)) from None
        chosen = _expand(graph, S, grouping, solution.choice)
        timeline = _timeline(graph, memory, chosen, mesh, states)
        peak = float(timeline.max(initial=0))
        log.info("memory: %d points constrained, ILP %.2fs, peak %s (budget %s)", len(points),
                 solution.seconds, format_bytes(peak), format_bytes(budget))
        if peak <= budget * (1 + FIT_TOLERANCE):
            return solution, chosen
        new_points = [p for p in memory.likely_peaks() + _violations(timeline, budget)
                      if p not in points]
        if not new_points:
            break
        points += new_points
        problem = replace(problem, **_memory_rows(memory, points), memory_budget=budget)
    raise MemoryNotSettled(f"could not fit the plan in {format_bytes(budget)} per device after "
                          f"{max_rounds} rounds of memory constraints")


def _memory_rows(memory: MemoryModel, points: list[int]) -> dict:
    """The ILP's memory rows at ``points``: bytes per strategy and the kept copies."""
    rows = [(terms, memory.kept_at(p)) for p in points for terms in memory.rows_at(p)]
    return {"memory_terms": [terms for terms, _ in rows],
            "memory_kept": [kept for _, kept in rows]}


def _solve(problem: ILPProblem, option: AutoShardingOption,
           initial: dict[str, int] | None) -> ILPSolution:
    return solve_ilp(problem, solver=option.solver, time_limit=option.time_limit,
                     gap=option.gap, initial=initial, max_nodes=option.max_nodes)


def _minimum_memory(graph, S, grouping, cg, memory: MemoryModel, points, option, mesh,
                    states) -> float:
    """The smallest peak any plan reaches (refining the checked points until exact)."""
    points = list(points)
    for _ in range(20):
        problem = ILPProblem(node_costs=cg.node_costs, edges=cg.edges, minimize_peak=True,
                             **_memory_rows(memory, points))
        solution = solve_ilp(problem, solver=option.solver, time_limit=option.time_limit,
                             max_nodes=option.max_nodes)
        peak, t = _peak(graph, memory, _expand(graph, S, grouping, solution.choice), mesh, states)
        if t in points or peak <= solution.objective * (1 + 1e-9):
            return peak
        points.append(t)
    return peak
