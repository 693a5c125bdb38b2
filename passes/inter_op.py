"""The inter-op pass (Alpa's PipeshardParallel): layers -> stages on submeshes -> plans.

1. Layers: the model's pipeline-boundary markers, or Alpa's layer construction.
2. Stage costs: each layer's ops are planned by the intra-op ILP on every view of every
   submesh (Alpa's submesh shapes, 1D and 2D logical shapes), once per distinct layer
   (identical layers share one solve). A range of layers costs the sum of its layers'
   step times, plus sending its boundary values to the next stage; its memory is the
   layers' model states, one micro-batch at its peak and what forward saved for every
   other micro-batch in flight (1F1B keeps one per stage still ahead, GPipe all).
   Solves are cached by structure (``passes/layer_cache.py``), within and across searches.
3. Stages: Alpa's DP (``passes/stages.py``) on those costs, with every stage it chooses
   priced again by the stage's own memory-constrained ILP until all chosen stages are
   exact (``_exact_search``), or stages given by hand, or uniform stages. With
   ``stage_option="profile"`` the DP uses layer times measured on the devices instead of
   the cost model's: ``layer_probes`` gives, for every distinct layer on every submesh
   view, an executable one-layer stage to time (the runtime times it), and
   ``plan_pipeline(measured=...)`` takes the results.
4. Each chosen stage's own graph is planned exactly on its submesh, and the stages,
   their transfers and an estimated timeline form the PipelinePlan.

The graph must be captured for one micro-batch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from torchalpa.core.cluster import Cluster
from torchalpa.core.opgraph import GraphOutputs, OpGraph, ValueRef
from torchalpa.core.options import (
    AutoShardingOption,
    ManualStageOption,
    PipeshardParallel,
    UniformStageOption,
)
from torchalpa.core.plan import PipelinePlan, Plan, StagePlan, Transfer
from torchalpa.core.plan_records import Estimates
from torchalpa.core.schedules import SCHEDULES, in_flight, simulate
from torchalpa.passes.ilp import InfeasibleError
from torchalpa.passes.intra_op import plan_intra_op
from torchalpa.passes.layer_cache import SOLVES, layer_signature, range_signature
from torchalpa.passes.layers import cluster_layers, layers_from_markers
from torchalpa.passes.memory import in_flight_bytes
from torchalpa.passes.stage_jobs import StageJobs, can_fork
from torchalpa.passes.stage_remat import (
    FORWARD_SHARE,
    received_bytes,
    recompute_memory,
    recompute_option,
    recompute_seconds,
    stage_recompute_allowed,
)
from torchalpa.passes.stages import stage_dp, submesh_shapes
from torchalpa.passes.subgraph import stage_subgraph
from torchalpa.passes.transplant import transplant
from torchalpa.passes.view_classes import reprice, view_class

__all__ = ["plan_pipeline", "assign_layers", "logical_views", "shardable_views",
           "searched_views", "layer_probes", "LayerProbe", "micro_batch_seconds"]

log = logging.getLogger("torchalpa.planner")


def assign_layers(graph: OpGraph, method: PipeshardParallel, num_devices: int) -> dict[str, int]:
    """Every node's layer: markers if the model has them, else Alpa's construction."""
    marked = layers_from_markers(graph)
    option = method.layer_option
    if marked is not None and option.layer_num == "auto":
        return marked
    forward_ops = sum(1 for n in graph.ops() if n.phase == "forward")
    num = option.layer_num if isinstance(option.layer_num, int) else \
        min(2 * num_devices, 16, forward_ops)
    return cluster_layers(graph, num, option.eps)


def logical_views(submesh: tuple[int, int]) -> list[tuple[int, ...]]:
    """Logical shapes a submesh is planned as (Alpa enumerates them per submesh): 1D, and
    every 2D ``(devices / inner, inner)`` whose inner axis stays within a node (``inner``
    divides the node's devices), so (1, 8) is tried as (8,), (4, 2), (2, 4) and (2, 8) as
    (16,), (8, 2), (4, 4), (2, 8): every (dp, tp) grid with tp within a node is a view."""
    n, m = submesh
    devices = n * m
    views: list[tuple[int, ...]] = [(devices,)]
    for inner in range(2, m + 1):
        if m % inner == 0 and devices // inner > 1:
            views.append((devices // inner, inner))
    return views


def tensor_dims(graph: OpGraph) -> frozenset[int]:
    """Every dim size of every value in the graph."""
    return frozenset(d for node in graph for spec in node.outputs for d in spec.shape)


def shardable_views(submesh: tuple[int, int], dims: frozenset[int]) -> list[tuple[int, ...]]:
    """The submesh's ``logical_views`` on which every mesh axis can shard some dim.

    Shardings split a dim evenly or not at all (``passes/strategies.py`` drops uneven
    splits; there is no padding), so an axis whose size divides no dim of any value in the
    graph (49 devices for a batch of 8, hidden 5120, ...) keeps everything replicated along
    it: every device on the axis repeats the same work, and the view costs what the view
    without that axis costs while holding more devices. Such views are skipped without a
    solve; on a 50-node cluster they are most of the node counts the DP would otherwise
    plan every distinct layer on (issue 15, item 4)."""
    return [view for view in logical_views(submesh)
            if all(size == 1 or any(d % size == 0 for d in dims) for size in view)]


def searched_views(submesh: tuple[int, int], dims: frozenset[int],
                   allow_mixed_mesh_shape: bool = True) -> list[tuple[int, ...]]:
    """The ``shardable_views`` of ``submesh`` the pipeline search plans layers on: all but
    the 1D view of a submesh of several nodes, when dims may be split over both axes of a
    2D view (``allow_mixed_mesh_shape``).

    That 1D view prices every collective on the link between nodes, over all its devices;
    the (nodes, devices per node) view offers each of its splits as a split over both
    axes (legal where the 1D one is: the same device count divides the dim) and prices
    it as a collective between nodes over ``nodes`` devices plus one within each node,
    which is cheaper unless the bytes are so few that the second latency outweighs the
    saving. On LLaMA-2-13B on 50 x 4 the 1D views' layers were 2-8x slower than on a 2D
    view of the same submesh (measured), and they were a third of the solves."""
    views = shardable_views(submesh, dims)
    if allow_mixed_mesh_shape and submesh[0] > 1 and submesh[1] > 1:
        views = [v for v in views if len(v) > 1]
    return views


def view_notes(submeshes: list[tuple[int, int]], dims: frozenset[int],
               allow_mixed_mesh_shape: bool = True) -> list[str]:
    """Plan notes naming the logical views the pipeline search skipped, and why."""
    unshardable, flat, unused = [], [], []
    for submesh in submeshes:
        shardable = shardable_views(submesh, dims)
        searched = searched_views(submesh, dims, allow_mixed_mesh_shape)
        unshardable += [v for v in logical_views(submesh) if v not in shardable]
        flat += [v for v in shardable if v not in searched]
        if not shardable:
            unused.append(submesh)
    notes = []
    if unshardable:
        left_out = f", so no stage is placed on submesh {_views_text(unused)}" if unused else ""
        notes.append(
            f"pipeline search: {len(unshardable)} logical views skipped because a mesh axis "
            f"divides no dim of any value in the step ({_views_text(unshardable)}){left_out}:"
            " a split must divide a dim evenly (no padding), so such an axis could only "
            "replicate, every device on it repeating the same work; give such a submesh by "
            "hand (ManualStageOption) to use it anyway")
    if flat:
        notes.append(
            f"pipeline search: {len(flat)} 1D views of multi-node submeshes skipped "
            f"({_views_text(flat)}): the (nodes, devices per node) view of the same submesh "
            "offers each of their splits over both axes, priced more cheaply")
    return notes


def _views_text(views: list[tuple[int, ...]], most: int = 6) -> str:
    shown = ", ".join(str(v) for v in views[:most])
    return shown + (f", ... {len(views) - most} more" if len(views) > most else "")


def _submesh_cluster(cluster: Cluster, submesh: tuple[int, int]) -> Cluster:
    return replace(cluster, num_nodes=submesh[0], devices_per_node=submesh[1])


def _layer_signatures(graph: OpGraph, layer: dict[str, int], num_layers: int) -> list[str]:
    members: list[list[str]] = [[] for _ in range(num_layers)]
    for node in graph:
        members[layer[node.name]].append(node.name)
    return [layer_signature(graph, names) for names in members]


@dataclass
class _Estimate:
    seconds: float
    state: float
    activations: float     # peak of one micro-batch
    saved: float           # what one micro-batch holds between its forward and backward


def _stage_memory(parts: list[_Estimate], in_flight_batches: int) -> float:
    """Bytes per device of layers run as one stage: each layer's saved activations, one
    layer's working set above that, and the saved activations of every micro-batch in
    flight (summing per-layer peaks would count every layer's working set at once)."""
    saved = sum(p.saved for p in parts)
    peak = saved + max(p.activations - p.saved for p in parts)
    return in_flight_bytes(sum(p.state for p in parts), peak, saved, in_flight_batches)


_WORKER_COSTS = None


def _solve_in_worker(args):
    costs = _WORKER_COSTS
    assert costs is not None, "set before the workers fork"
    return costs._solve_members(*args)


def _stage_in_worker(args):
    """``_solve_stage`` in a forked worker: its result, the stage plans it made and its
    solve count (the worker's own copy of the costs is dropped with it)."""
    costs = _WORKER_COSTS
    assert costs is not None, "set before the workers fork"
    had, solves = set(costs.exact_plans), costs.exact_solves
    result = costs._solve_stage(*args)
    made = {key: plan for key, plan in costs.exact_plans.items() if key not in had}
    counted = costs.exact_solves - solves
    # the caller adds ``counted``: undo it here, where ``_map`` ran this in the searching
    # process itself (JAX loaded) and ``costs`` is the caller's own object, not a copy
    costs.exact_solves = solves
    return result, made, counted


def micro_batch_seconds(estimates, num_micro_batches: int) -> float:
    """A stage plan's seconds per micro-batch in a pipeline of ``num_micro_batches``: what
    it runs for every micro-batch, plus its share of what it runs once per step
    (``once_per_step_s``: the gradients' final resharding, the optimizer), so that Alpa's
    objective (the sum of the stages' latencies plus ``B - 1`` times the slowest) counts
    those once, not ``B`` times."""
    once = estimates.get("once_per_step_s") or 0.0
    return estimates["step_time_s"] - once + once / num_micro_batches


def _estimate_of(plan, num_micro_batches: int) -> _Estimate | None:
    if plan is None:
        return None
    e = plan.estimates
    return _Estimate(micro_batch_seconds(e, num_micro_batches),
                     e["model_state_bytes_per_device"], e["activation_bytes_per_device"],
                     e["saved_activation_bytes_per_device"])


class _StageCosts:
    """Additive estimates of a range of layers on each submesh view (see module doc)."""

    def __init__(self, graph: OpGraph, layer: dict[str, int], cluster: Cluster,
                 method: PipeshardParallel, inputs: str, measured: dict | None = None,
                 share_views: bool = True):
        self.share_views = share_views
        self.graph, self.layer, self.cluster, self.method = graph, layer, cluster, method
        self.measured = measured   # (signature, view, submesh) -> seconds, when profiled
        self.num_layers = max(layer.values()) + 1
        self.inputs = inputs
        self.signature = _layer_signatures(graph, layer, self.num_layers)
        self.send_bytes = self._boundary_bytes()
        self.dims = tensor_dims(graph)
        # everything besides the layer's structure and the view that decides a solve
        self.context = (repr(cluster), repr(method.intra_op_method(None)), inputs)
        self.solves = 0
        self.repriced = 0     # views priced with their class's plan
        self.exact_solves = 0
        self.reused_in_flight = 0     # exact solves answered from fewer in flight
        self.transplanted = 0         # stage plans moved from identical layers elsewhere
        self.exact_plans: dict[tuple, Plan] = {}   # this graph's stage plans
        self._layer_graphs: dict[int, OpGraph] = {}
        self._layer_rules: dict[int, dict] = {}     # per layer: node -> its sharding rule
        # each stage also priced with its activations recomputed (passes/stage_remat.py)
        self.stage_recompute = stage_recompute_allowed(method, graph)
        self._received: dict[tuple[int, int], float] = {}

    def received(self, k: int, i: int) -> float:
        """Forward bytes layers k..i receive from earlier layers per micro-batch."""
        if (k, i) not in self._received:
            self._received[k, i] = received_bytes(
                self.graph, lambda name: k <= self.layer[name] <= i)
        return self._received[k, i]

    def _key(self, l: int, view: tuple[int, ...], submesh: tuple[int, int], lean: bool
             ) -> tuple:
        return ("layer", self.signature[l], view, submesh, lean, self.share_views,
                self.context)

    def _boundary_bytes(self) -> list[float]:
        """Bytes crossing the cut after layer l (both directions, one micro-batch)."""
        out = [0.0] * self.num_layers
        seen = set()
        for node in self.graph.ops():
            for ref in node.operands:
                a, b = self.layer[ref.node], self.layer[node.name]
                # the batch is on every stage; parameters (and gradient parts only summed
                # into a parameter's gradient) cross once per step, not per micro-batch
                if a != b and self.graph.node(ref.node).kind != "input" and (ref, b) not in seen \
                        and not _once_per_step(self.graph, ref, self.layer, b):
                    seen.add((ref, b))
                    for cut in range(min(a, b), max(a, b)):
                        out[cut] += self.graph.spec(ref).nbytes
        return out

    def prefetch(self, submeshes: list[tuple[int, int]], workers: int, max_in_flight: int
                 ) -> None:
        """Price every distinct layer on every searched view up front, ``workers`` at a
        time (the DP asks for all of them; each job is independent). With ``share_views``,
        views of one ``view_class`` share one ILP solve: the class's first view is solved,
        the others price that plan, and the lean (sharded-state) variants price it with
        its parameters sharded (``passes/view_classes.py``). Without it, every view is
        solved, and the lean variants follow by ILP for the views where the fastest plans
        may not fit."""
        views = [(view, submesh) for submesh in submeshes for view in self.views(submesh)]
        if self.share_views:
            self._solve_classes(views, workers)
            return
        self._solve_all([(l, ((view, submesh),), False) for view, submesh in views
                         for l in range(self.num_layers)], workers)
        budget = self.method.auto_sharding_option.memory_budget_per_device or \
            self.cluster.memory_per_device
        tight = []
        for view, submesh in views:
            parts = [SOLVES.peek(self._key(l, view, submesh, False))
                     for l in range(self.num_layers)]
            if any(p is None for p in parts) or _stage_memory(parts, max_in_flight) > budget:
                tight.append((view, submesh))
        self._solve_all([(l, ((view, submesh),), True) for view, submesh in tight
                         for l in range(self.num_layers)], workers)

    def views(self, submesh: tuple[int, int]) -> list[tuple[int, ...]]:
        """The logical views of ``submesh`` the search plans layers on: ``searched_views``
        (``shardable_views`` when ``share_views`` is off)."""
        if not self.share_views:
            return shardable_views(submesh, self.dims)
        return searched_views(submesh, self.dims,
                              self.method.auto_sharding_option.allow_mixed_mesh_shape)

    def _solve_classes(self, views: list[tuple], workers: int) -> None:
        """Every distinct layer on ``views`` ((view, submesh) pairs): one job per (layer,
        class of views), the class's first view solved and its plan priced on the rest."""
        classes: dict[object, list[tuple]] = {}
        for view, submesh in views:
            classes.setdefault(self.view_class(view, submesh), []).append((view, submesh))
        requests = []
        for l in range(self.num_layers):
            for members in classes.values():
                todo = tuple((view, submesh) for view, submesh in members
                             if self._key(l, view, submesh, False) not in SOLVES
                             or self._key(l, view, submesh, True) not in SOLVES)
                if todo:
                    requests.append((l, todo, None))
        self._solve_all(requests, workers)

    def view_class(self, view: tuple[int, ...], submesh: tuple[int, int]):
        """The ``view_class`` of ``view`` on ``submesh`` for this graph's dims."""
        return view_class(_submesh_cluster(self.cluster, submesh).logical_mesh(view), self.dims)

    def _solve_all(self, requests: list[tuple], workers: int) -> None:
        """Run ``_solve_members`` jobs (layer, (view, submesh) members, lean) and store
        each member's estimates."""
        todo = {}
        for l, members, lean in requests:
            key = (self.signature[l], members, lean)
            todo.setdefault(key, (l, members, lean))
        for l in {args[0] for args in todo.values()}:
            self._layer_graph(l)  # made here, so that forked workers inherit them
        global _WORKER_COSTS
        _WORKER_COSTS = self      # forked workers read it instead of unpickling the graph
        # largest meshes first so the pool stays busy to the end
        jobs = sorted(todo.values(), key=lambda args: -math.prod(args[1][0][0]))
        solves, repriced = self.solves, self.repriced
        results = _map(_solve_in_worker, jobs, workers)
        for (l, _members, _), (estimates, counts) in zip(jobs, results):
            for (view, submesh, lean), estimate in estimates.items():
                SOLVES.put(self._key(l, view, submesh, lean), estimate)
            solves += counts[0]    # workers counted theirs in their own copies
            repriced += counts[1]
        self.solves, self.repriced = solves, repriced

    def _solve_members(self, l: int, members: tuple, lean: bool | None
                       ) -> tuple[dict[tuple, _Estimate | None], tuple[int, int]]:
        """Layer ``l`` on the first of ``members`` (views of one class) by the ILP, and
        on each other one by pricing that plan there; a member the plan does not carry
        over to (not expected within a class) is solved by its own ILP. ``lean`` None:
        both variants, the lean ones priced from the fastest plan. Returns the estimates
        by (view, submesh, lean) and (ILP solves, views priced without one)."""
        solves, repriced = self.solves, self.repriced
        out: dict[tuple, _Estimate | None] = {}
        (first_view, first_submesh) = members[0]
        first = self._layer_plan(l, first_view, first_submesh, bool(lean))
        variants = (False, True) if lean is None else (lean,)
        for view, submesh in members:
            for variant in variants:
                plan = first if (view, submesh) == members[0] and variant == bool(lean) \
                    else self._priced(l, first, view, submesh, variant)
                out[(view, submesh, variant)] = _estimate_of(
                    plan, self.method.num_micro_batches)
        return out, (self.solves - solves, self.repriced - repriced)

    def _priced(self, l: int, plan, view, submesh, lean: bool):
        """``plan`` of layer ``l`` priced on ``view`` (made lean if ``lean``), or solved
        there if it does not carry over."""
        found = None if plan is None else reprice(
            self._layer_graph(l), plan, self._layer_mesh(view, submesh),
            self._layer_method(lean), self.inputs, relayout_parameters=lean,
            rules=self._layer_rules.setdefault(l, {}))
        if found is None:
            return self._layer_plan(l, view, submesh, lean)
        self.repriced += 1
        return found

    def layer_estimate(self, l: int, view: tuple[int, ...], submesh, lean: bool
                       ) -> _Estimate | None:
        estimate = SOLVES.get(self._key(l, view, submesh, lean),
                              lambda: self._solve_layer(l, view, submesh, lean))
        timed = None if self.measured is None else \
            self.measured.get((self.signature[l], view, submesh))
        if estimate is None or timed is None:
            return estimate
        # measured time of the fastest plan; a lean plan adds what the model says its
        # extra gathers cost
        extra = 0.0
        if lean:
            fastest = self.layer_estimate(l, view, submesh, False)
            extra = max(0.0, estimate.seconds - fastest.seconds) if fastest else 0.0
        return replace(estimate, seconds=timed + extra)

    def range_seconds(self, k: int, i: int, view, submesh) -> float | None:
        """Measured seconds of layers k..i on a view, if every one was timed."""
        if self.measured is None:
            return None
        parts = [self.measured.get((self.signature[l], view, submesh)) for l in range(k, i + 1)]
        return None if any(p is None for p in parts) else sum(parts)

    def _layer_graph(self, l: int) -> OpGraph:
        """Layer ``l`` alone as a graph, its boundary values free to stay in any layout
        (priced per stage instead); made once per layer and reused on every view."""
        sub = self._layer_graphs.get(l)
        if sub is None:
            stage_of = {n: (0 if v == l else 1) for n, v in self.layer.items()}
            sub = stage_subgraph(self.graph, stage_of, 0).graph
            sub = self._layer_graphs[l] = OpGraph(
                list(sub), GraphOutputs(loss=sub.outputs.loss, grads=sub.outputs.grads,
                                        buffer_updates=sub.outputs.buffer_updates), sub.meta)
        return sub

    def _solve_layer(self, l, view, submesh, lean) -> _Estimate | None:
        return _estimate_of(self._layer_plan(l, view, submesh, lean),
                            self.method.num_micro_batches)

    def _layer_mesh(self, view: tuple[int, ...], submesh: tuple[int, int]):
        return replace(_submesh_cluster(self.cluster, submesh).logical_mesh(view),
                       memory_per_device=None)

    def _layer_method(self, lean: bool):
        # an estimate: the simplified ILP (shared block decisions, merged followers, no
        # alternating layers) is within a few percent of the unsimplified one at a fifth
        # of the time; the stages the DP picks are priced by their own ILP, followers
        # freed and layers alternating where that pays
        option = replace(self.method.auto_sharding_option, exact_below=0, free_followers_below=0,
                         alternate_blocks=False, **({"parameters": "sharded"} if lean else {}))
        return self.method.intra_op_method(option)

    def _layer_plan(self, l, view, submesh, lean):
        """Layer ``l``'s own intra-op plan on ``view`` (None if none exists)."""
        sub = self._layer_graph(l)
        self.solves += 1
        try:
            return plan_intra_op(sub, self._layer_mesh(view, submesh), self._layer_method(lean),
                                 inputs=self.inputs,
                                 blocks=sub.meta.get("repeated_blocks") or None)
        except InfeasibleError:
            return None

    def budget(self) -> float:
        return self.method.auto_sharding_option.memory_budget_per_device or \
            self.cluster.memory_per_device

    def send_seconds(self, k: int, i: int) -> float:
        """Seconds to send layers k..i's boundary values (one micro-batch, both ways)."""
        link = self.cluster.inter_node_bandwidth if self.cluster.num_nodes > 1 else \
            self.cluster.intra_node_bandwidth
        sends = (self.send_bytes[i] if i < self.num_layers - 1 else 0.0) + \
            (self.send_bytes[k - 1] if k > 0 else 0.0)
        return sends / link

    def candidates(self, k: int, i: int, submesh: tuple[int, int], in_flight_batches: int
                   ) -> list[tuple[float, float, tuple[int, ...], bool, bool]]:
        """(latency, additive memory, view, lean, recompute) of layers k..i on each view of
        ``submesh``: the fastest plan, and the lean one where the fastest does not fit;
        each also with its activations recomputed where the search may choose that."""
        out = []
        sends = self.send_seconds(k, i)
        for view in self.views(submesh):
            for lean in (False, True):
                found = [self.layer_estimate(l, view, submesh, lean) for l in range(k, i + 1)]
                parts = [p for p in found if p is not None]
                if len(parts) < len(found):
                    continue
                memory = _stage_memory(parts, in_flight_batches)
                seconds = sum(p.seconds for p in parts)
                out.append((seconds + sends, memory, view, lean, False))
                if self.stage_recompute:
                    out.append(self._recomputed(k, i, parts, seconds + sends, view, lean,
                                                in_flight_batches))
                if memory <= self.budget():
                    break
        return out

    def _recomputed(self, k, i, parts: list[_Estimate], seconds: float, view, lean,
                    in_flight_batches: int) -> tuple[float, float, tuple[int, ...], bool, bool]:
        """The recomputed variant of a candidate: one more forward of its layers, and
        only the received activations kept for the micro-batches not at their peak."""
        compute = sum(p.seconds for p in parts)
        saved = sum(p.saved for p in parts)
        peak = saved + max(p.activations - p.saved for p in parts)
        memory = recompute_memory(sum(p.state for p in parts), peak, self.received(k, i),
                                  in_flight_batches)
        return seconds + compute * FORWARD_SHARE, memory, view, lean, True

    def cost(self, k: int, i: int, submesh: tuple[int, int], in_flight_batches: int
             ) -> tuple[float, tuple[tuple[int, ...], bool, bool] | None]:
        """(latency, (best logical view, lean, recompute)) of layers k..i on ``submesh``,
        inf if none fits by the additive estimate."""
        fits = [(t, (view, lean, recompute)) for t, memory, view, lean, recompute in
                self.candidates(k, i, submesh, in_flight_batches) if memory <= self.budget()]
        return min(fits, key=lambda c: c[0]) if fits else (math.inf, None)

    def exact(self, k: int, i: int, submesh: tuple[int, int], view: tuple[int, ...],
              in_flight_batches: int, recompute: bool = False, budget: float | None = None
              ) -> tuple[float, AutoShardingOption | None]:
        """Latency of layers k..i as one stage by its own memory-constrained ILP (with its
        micro-batches in flight) on ``view``, and the option that fits (None: the method's
        own; else sharded states); inf if neither fits. ``recompute``: the stage
        checkpointed (``passes/stage_remat.py``). ``budget``: seconds each of the stage's
        ILP solves may take at most (``_search_option``). Cached by the range's structure, so
        ranges of identical layers are solved once, and reused from fewer micro-batches in
        flight where that plan still fits (``_reuse_fewer_in_flight``)."""
        received = self.received(k, i) if recompute else 0.0
        key = self._stage_key(k, i, submesh, view, in_flight_batches, recompute, budget)
        self._answer_budgeted_by_full(k, i, submesh, view, in_flight_batches, recompute,
                                      budget)
        if key not in SOLVES:
            self._reuse_fewer_in_flight(k, i, submesh, view, in_flight_batches, recompute,
                                        budget)
        seconds, lean, _ = SOLVES.get(key, lambda: self._solve_stage(
            k, i, submesh, view, in_flight_batches, received if recompute else None, budget))
        return self._priced_stage(k, i, seconds, lean, recompute)

    def _answer_budgeted_by_full(self, k: int, i: int, submesh, view, flight: int,
                                 recompute: bool, budget: float | None) -> None:
        """A budgeted solve asked for where the full solve of the same stage is known:
        store that one for it (a budget only stops solves early, so the full plan is at
        least as good). GPT-39B's 64-device row: a uniform partition's layers 2-3 are the
        DP's layers 3-4, the same structure, already solved in full."""
        if budget is None:
            return
        key = self._stage_key(k, i, submesh, view, flight, recompute, budget)
        full = self._stage_key(k, i, submesh, view, flight, recompute)
        if key not in SOLVES and full in SOLVES:
            SOLVES.put(key, SOLVES.peek(full))

    def known_exact(self, k: int, i: int, submesh: tuple[int, int], view: tuple[int, ...],
                    in_flight_batches: int, recompute: bool = False
                    ) -> tuple[float, AutoShardingOption | None]:
        """``exact``'s answer (unbudgeted) where its solve, or one with fewer micro-batches
        in flight that decides it, is known already; inf where neither is. Solves and
        stores nothing."""
        flight = in_flight_batches
        if self._stage_key(k, i, submesh, view, flight, recompute) not in SOLVES:
            flight = self._fewer_that_decides(k, i, submesh, view, flight, recompute, None)
            if flight is None:
                return math.inf, None
        seconds, lean, _ = SOLVES.peek(self._stage_key(k, i, submesh, view, flight, recompute))
        return self._priced_stage(k, i, seconds, lean, recompute)

    def _priced_stage(self, k: int, i: int, seconds: float | None, lean: bool,
                      recompute: bool) -> tuple[float, AutoShardingOption | None]:
        """A stage solve's result as ``exact`` returns it: latency with its sends (inf if
        nothing fit) and the option that fits."""
        if seconds is None:
            return math.inf, None
        option = replace(self.method.auto_sharding_option, parameters="sharded") if lean \
            else None
        if recompute:
            seconds = recompute_seconds(seconds)
        return seconds + self.send_seconds(k, i), option

    def _stage_key(self, k: int, i: int, submesh, view, in_flight_batches: int,
                   recompute: bool, budget: float | None = None) -> tuple:
        """What ``exact`` caches a stage's solve under: its layers' structure, where it sits,
        its view, micro-batches in flight, and the time budget its solves ran under (a
        budgeted solve may stop short of the optimum a full one finds)."""
        return ("stage", range_signature(self.signature, k, i), k == 0,
                i == self.num_layers - 1, view, submesh, in_flight_batches, self.context) + \
            ((("recompute", self.received(k, i)),) if recompute else ()) + \
            ((("budget", budget),) if budget is not None else ())

    def _fits(self, memory: tuple[float, float, float], k: int, i: int, flight: int,
              recompute: bool) -> bool:
        """Whether a stage plan of layers k..i with ``memory`` (model states, one
        micro-batch's activation peak, what it saves for backward) fits the budget with
        ``flight`` micro-batches in flight, as ``plan_intra_op`` counts them (recomputed:
        one micro-batch planned in what the others' received inputs leave)."""
        state, peak, saved = memory
        if recompute:
            return in_flight_bytes(state, peak, saved, 1) <= \
                self.budget() - (flight - 1) * self.received(k, i)
        return in_flight_bytes(state, peak, saved, flight) <= self.budget()

    def _reuse_fewer_in_flight(self, k: int, i: int, submesh, view, flight: int,
                               recompute: bool, budget: float | None) -> bool:
        """Answer the stage's exact solve with ``flight`` micro-batches in flight from a
        solve of the same range with fewer, where one exists and decides it, without an
        ILP. Exact by monotonicity: more micro-batches in flight only add memory, so the
        best plan with fewer is at least as fast as any with more; when it also fits with
        ``flight``, it is the best there too. And when nothing fit with fewer, nothing
        fits with more. (1F1B's stages keep 1..B micro-batches in flight, so the DP asks
        for the same range at several counts; GPT-39B's two-layer stages gave the same
        0.7898 s plan at six of them, 8-60 s each.) The solve may be of identical layers
        at another depth: the pipeline's assembly moves that plan onto these layers
        (``donated``). Returns whether it answered."""
        fewer = self._fewer_that_decides(k, i, submesh, view, flight, recompute, budget)
        if fewer is None:
            return False
        found = SOLVES.peek(self._stage_key(k, i, submesh, view, fewer, recompute, budget))
        lean = found[1]
        plan = self.exact_plans.get((k, i, submesh, view, lean, fewer, recompute))
        SOLVES.put(self._stage_key(k, i, submesh, view, flight, recompute, budget), found)
        if plan is not None:
            self.exact_plans[(k, i, submesh, view, lean, flight, recompute)] = plan
        self.reused_in_flight += 1
        return True

    def _fewer_that_decides(self, k: int, i: int, submesh, view, flight: int,
                            recompute: bool, budget: float | None) -> int | None:
        """The most micro-batches in flight, below ``flight``, whose solve of the stage
        decides it with ``flight`` (``_reuse_fewer_in_flight``); None if none does."""
        for fewer in range(flight - 1, 0, -1):
            key = self._stage_key(k, i, submesh, view, fewer, recompute, budget)
            if key not in SOLVES:
                continue
            seconds, _, memory = SOLVES.peek(key)
            if seconds is not None and not self._fits(memory, k, i, flight, recompute):
                continue
            return fewer
        return None

    def donated(self, k: int, i: int, submesh, view, lean: bool, flight: int,
                recompute: bool, request: tuple) -> Plan | None:
        """A plan for layers k..i as a stage (``request``: what ``_plan_stage`` would
        solve it from) moved from a solved plan of identical layers elsewhere
        (``passes/transplant.py``) that is also this stage's best: one solved with as many
        micro-batches in flight, or with fewer and still fitting (the argument of
        ``_reuse_fewer_in_flight``). None if there is none."""
        shape = (range_signature(self.signature, k, i), k == 0, i == self.num_layers - 1)
        graph, mesh, method, inputs, _ = request
        for (k2, i2, sm, v, ln, f2, rc), plan in list(self.exact_plans.items()):
            if (sm, v, ln, rc) != (submesh, view, lean, recompute) or (k2, i2) == (k, i) \
                    or f2 > flight:
                continue
            if (range_signature(self.signature, k2, i2), k2 == 0,
                    i2 == self.num_layers - 1) != shape:
                continue
            e = plan.estimates
            memory = (e["model_state_bytes_per_device"], e["activation_bytes_per_device"],
                      e["saved_activation_bytes_per_device"])
            if f2 < flight and not self._fits(memory, k, i, flight, recompute):
                continue
            stage_of = {n: (0 if k2 <= at <= i2 else 1) for n, at in self.layer.items()}
            donor = stage_subgraph(self.graph, stage_of, 0).graph
            moved = transplant(plan, donor, graph, mesh, method, inputs)
            if moved is not None:
                self.exact_plans[(k, i, submesh, view, lean, flight, recompute)] = moved
                self.transplanted += 1
                return moved
        return None

    def solve_stages(self, stages: list[tuple], jobs: StageJobs, budget: float | None = None,
                     later: Callable[[], list[tuple]] = list) -> None:
        """Solve the stages (k, i, submesh, view, in flight, recompute) that ``exact`` has
        not yet, by ``jobs`` (forked workers), and keep them where ``exact`` finds them:
        the DP's stages of one round are independent solves (one to two minutes each for
        GPT-15B's two-layer stages), run one after another before. A range asked for at
        several micro-batches in flight is solved at the fewest first, in waves, so that
        the others may follow from it (``_reuse_fewer_in_flight``); a wave with fewer
        ranges than workers also solves the most-in-flight of them, and a worker left idle
        within a wave guesses the next wave's solves, then the stages (as in ``stages``)
        ``later`` says later rounds may ask for (``StageJobs``: guesses change the search's
        time, never its answer). ``budget``: as in ``exact``."""
        todo: dict[tuple, tuple] = {}
        for k, i, submesh, view, flight, recompute in stages:
            self._answer_budgeted_by_full(k, i, submesh, view, flight, recompute, budget)
            key = self._stage_key(k, i, submesh, view, flight, recompute, budget)
            if key not in SOLVES and key not in todo:
                todo[key] = (k, i, submesh, view, flight, recompute)

        def job(args: tuple, budget: float | None = budget) -> tuple:
            k, i, submesh, view, flight, recompute = args
            return (k, i, submesh, view, flight, self.received(k, i) if recompute else None,
                    budget)

        def store(key: tuple, value: tuple) -> None:
            result, plans, solves = value
            SOLVES.put(key, result)
            self.exact_plans.update(plans)
            self.exact_solves += solves

        def guess() -> list[tuple]:
            # the next wave first: the most in flight of a range, which the fewest one
            # answers least often; then what later rounds may ask for
            def open_(key: tuple, args: tuple, budget: float | None) -> bool:
                k, i, submesh, view, flight, recompute = args
                return key not in SOLVES and self._fewer_that_decides(
                    k, i, submesh, view, flight, recompute, budget) is None

            wave = sorted((item for item in todo.items() if open_(*item, budget)),
                          key=lambda item: -item[1][4])
            rounds = [(self._stage_key(k, i, submesh, view, flight, recompute), args)
                      for args in later()
                      for k, i, submesh, view, flight, recompute in [args]]
            return [(key, job(args)) for key, args in wave] + \
                [(key, job(args, None)) for key, args in rounds if open_(key, args, None)]

        jobs.on_result, jobs.guess = store, guess
        while todo:
            todo = {key: (k, i, submesh, view, flight, recompute)
                    for key, (k, i, submesh, view, flight, recompute) in todo.items()
                    if not self._reuse_fewer_in_flight(k, i, submesh, view, flight, recompute,
                                                       budget)}
            fewest: dict[tuple, tuple[tuple, tuple]] = {}
            for key, args in sorted(todo.items(), key=lambda item: item[1][4]):
                k, i, submesh, view, _, recompute = args
                fewest.setdefault(self._stage_key(k, i, submesh, view, 0, recompute, budget),
                                  (key, args))
            wave = list(fewest.values())
            # idle workers take the most micro-batches in flight of a range, the solve the
            # fewest one is least likely to answer
            spare = sorted((item for item in todo.items() if item not in wave),
                           key=lambda item: -item[1][4])
            wave += spare[:max(0, jobs.workers - len(wave))]
            jobs.solve([(key, job(args)) for key, args in wave])
            for key, _ in wave:
                del todo[key]

    def _solve_stage(self, k, i, submesh, view, in_flight_batches, received: float | None,
                     budget: float | None = None
                     ) -> tuple[float | None, bool, tuple[float, float, float] | None]:
        """The stage's exact plan, kept (``received`` None) or recomputed: then planned
        with one micro-batch in flight within the budget the others' inputs leave.
        ``budget``: seconds each ILP solve may take at most (``_search_option``).
        Returns (latency, lean, (model states, activation peak, saved activations) per
        device), latency None where nothing fits."""
        stage_of = {n: (0 if k <= v <= i else 1) for n, v in self.layer.items()}
        sub = stage_subgraph(self.graph, stage_of, 0).graph
        mesh = _submesh_cluster(self.cluster, submesh).logical_mesh(view)
        for lean in (False, True):
            option = replace(self.method.auto_sharding_option, parameters="sharded") \
                if lean else None
            if received is not None:
                option = recompute_option(option or self.method.auto_sharding_option,
                                          self.budget(), received, in_flight_batches)
                if option is None:
                    return None, False, None
            option = _search_option(option or self.method.auto_sharding_option, budget)
            self.exact_solves += 1
            try:
                plan = _plan_stage((sub, mesh, self.method.intra_op_method(option),
                                    self.inputs, 1 if received is not None else in_flight_batches))
            except InfeasibleError:
                continue
            self.exact_plans[(k, i, submesh, view, lean, in_flight_batches,
                              received is not None)] = plan
            e = plan.estimates
            return micro_batch_seconds(e, self.method.num_micro_batches), lean, (
                e["model_state_bytes_per_device"],
                                            e["activation_bytes_per_device"],
                                            e["saved_activation_bytes_per_device"])
        return None, False, None


MEMORY_SLACK = 2.0
"""How far over the budget an additive memory estimate may be for the exact stage ILP to
be asked (GPT-39B, 2 layers, 8 micro-batches in flight: additive 126-140 GB, exact 79 GB
of 80)."""

UNIFORM_TIME_LIMIT: float | None = 10.0
"""Seconds each ILP solve of a uniform partition's stage may take (``_exact_search``), in
place of the method's ``time_limit`` where that is longer; None: no budget of its own.
Those stages are priced only to offer the search an alternative, so their solves stop
early: any feasible plan's time is an upper bound of the stage's optimum."""

SEARCH_RESOLVE_BELOW = 600
"""A stage the search prices exactly (the DP's picks and the uniform partitions') is also
re-solved unsimplified (``AutoShardingOption.exact_below``) only when its graph has at
most this many nodes (and at most the method's ``exact_below``); every stage solve still
lets its followers decide on their own (``AutoShardingOption.free_followers_below``). On
GPT-39B (8 x 8 H100) the unsimplified re-solves were most of the search: 11-62 s for a
2-layer stage (794-843 nodes, ~205k columns), 23-102 s for a 4-layer one (1586-1598 nodes,
~380k columns, some stopped by the 60 s limit), where freeing the followers alone took
1-13 s and came within 0.27 % of them (``benchmarks/stage_resolve.py``; the small case is
``tests/test_free_followers.py``). The tests' small GPT stages (134-589 nodes) are still re-solved: there the
re-solve is cheap and once found a 5 % faster stage."""

MAX_EXACT_ROUNDS = 8
"""Rounds of (stage DP, exact pricing of the stages it chose that were not yet exact)."""

UNIFORM_MARGIN = 0.02
"""How far above the search's exact answer a uniform partition's additive estimate may be
for its stages to be priced exactly too (``_uniform_layouts``). The per-layer sums miss
what a stage's own ILP saves across its layers (GPT-15B's two-layer stages on (1, 8) as
(2, 4): dearer by the sums, cheaper exactly), so a uniform partition the sums rank just
behind the answer may beat it; ``math.inf`` prices every uniform partition."""


def _exact_search(costs: _StageCosts, L: int, cluster: Cluster, B: int, schedule: str,
                  shapes: list[tuple[int, int]]):
    """Alpa's stage DP with the stages that decide it priced exactly.

    A (layer range, submesh, micro-batches in flight) has variants: each logical view,
    kept or recomputed (``passes/stage_remat.py``). Each variant starts at its additive
    estimate, or, where that says "does not fit" but is near fitting, at the fastest
    additive plan's latency (optimistic); the candidate costs its cheapest variant. Each
    round runs the DP, then prices the variant each stage of its answer took, if not yet
    priced, with the stage's own memory-constrained ILP and replaces that variant's
    estimate by it (inf if no plan fits), so the candidate falls back to its next variant
    (another view, recomputation) when the exact plan is slower or does not fit. When
    every stage of an answer is exact, the uniform partitions (``_uniform_layouts``: a
    hand grid's stage split) whose estimates come within ``UNIFORM_MARGIN`` of it are
    priced exactly too, once, and the rounds go on until an answer is exact again: the
    per-layer sums miss a stage's cross-layer savings, and this way the answer is never
    slower than such a uniform partition planned by the same stage ILP. With measured
    layer times (``stage_option="profile"``) the DP runs once on them. Returns the
    solution, per stage (view, option, recompute), and how many variants were priced
    exactly."""
    exact: dict[tuple, dict[tuple, tuple[float, tuple | None]]] = {}
    measured = costs.measured is not None
    # a variant's additive estimate does not change between rounds (only ``exact`` does)
    variants: dict[tuple, dict] = {}
    choice: dict[tuple, tuple[tuple, bool] | None] = {}    # key -> (picked, exact?)

    def flight_of(after: int) -> int:
        return min(B, after + 1) if schedule == "1f1b" else B

    def cost(k, i, j, after, guess=True):
        """A stage's latency: its cheapest variant, exact where it was priced so, else the
        per-layer sum or, with ``guess``, the optimistic estimate (a stage the sum calls
        too big, to be priced exactly if the DP picks it)."""
        key = (k, i, j, flight_of(after))
        best: tuple[float, tuple[tuple, bool] | None] = (math.inf, None)
        priced = exact.get(key, {})
        shown = variants.get((key, guess))
        if shown is None:
            shown = variants[key, guess] = _variants(costs, k, i, shapes[j], key[3],
                                                     guess and not measured)
        for variant, (latency, chosen) in shown.items():
            if variant not in priced and latency < best[0]:
                best = (latency, (chosen, False))
        for latency, chosen in priced.values():
            if chosen is not None and latency < best[0]:
                best = (latency, (chosen, True))
        choice[key] = best[1]
        return best[0]

    def keys(solution):
        return [(st.layers[0], st.layers[1], shapes.index(st.submesh),
                 flight_of(len(solution.stages) - 1 - n)) for n, st in enumerate(solution.stages)]

    def uniform_picks(bound: float) -> list[tuple[tuple, tuple]]:
        """(key, (view, lean, recompute)) of the stages of every uniform partition whose
        cheapest stage variants on one view, exact where priced, total at most ``bound``
        by the DP's objective, and not yet priced exactly."""
        out = []
        for pp, j in _uniform_layouts(L, cluster, shapes):
            per = L // pp
            stage_keys = [(s * per, (s + 1) * per - 1, j, flight_of(pp - 1 - s))
                          for s in range(pp)]
            for view in costs.views(shapes[j]):
                found = [_view_best(costs, key, shapes[j], view, exact.get(key, {}))
                         for key in stage_keys]
                best = [b for b in found if b is not None]
                if len(best) < len(found):      # a stage of it has no variant that may fit
                    continue
                latencies = [b[0] for b in best]
                total = sum(latencies) + (B - 1) * max(latencies)
                log.info("pipeline search: uniform %d stages on %s as %s: %.6g s by the DP's"
                         " objective (%d of %d stages exact), bound %.6g s", pp, shapes[j],
                         view, total, sum(b[2] for b in best), pp, bound)
                if total <= bound:
                    out += [(key, b[1]) for key, b in zip(stage_keys, best) if not b[2]]
        return out

    def uniform_exact() -> list[list[tuple]]:
        """Every uniform partition whose stages on one view were all priced exactly and
        fit, as stages ((first, last), submesh, view, option, recompute)."""
        out = []
        for pp, j in _uniform_layouts(L, cluster, shapes):
            per = L // pp
            for view in costs.views(shapes[j]):
                stages = []
                for s in range(pp):
                    key = (s * per, (s + 1) * per - 1, j, flight_of(pp - 1 - s))
                    found = [(latency, chosen) for (v, _), (latency, chosen)
                             in exact.get(key, {}).items() if v == view and chosen is not None]
                    if not found:
                        break
                    _, (_, option, recompute) = min(found, key=lambda f: f[0])
                    stages.append((key[:2], shapes[j], view, option, recompute))
                else:
                    out.append(stages)
        return out

    round_picks: list[tuple] = []

    def next_round() -> list[tuple]:
        """The stages (k, i, submesh, view, in flight, recompute) the DP's answer prices
        next if every stage of this round not yet solved turns out not to fit: what the
        next round asks for when those come in dearer than their estimates (GPT-39B: the
        first stage, memory-bound, on another view, then on a larger submesh)."""
        if not round_picks:
            return []
        saved = {key: dict(priced) for key, priced in exact.items()}, dict(choice)
        try:
            for key, (view, _, recompute) in round_picks:
                k, i, j, flight = key
                latency, option = costs.known_exact(k, i, shapes[j], view, flight, recompute)
                exact.setdefault(key, {})[view, recompute] = (
                    latency, (view, option, recompute) if math.isfinite(latency) else None)
            guess = stage_dp(L, cluster.num_nodes, cluster.devices_per_node, B, cost)
            out = []
            for key in keys(guess):
                (view, _, recompute), is_exact = _picked(choice, key)
                if not is_exact:
                    k, i, j, flight = key
                    out.append((k, i, shapes[j], view, flight, recompute))
            return out
        except ValueError:       # nothing fits
            return []
        finally:
            exact.clear()
            exact.update(saved[0])
            choice.clear()
            choice.update(saved[1])

    solution = None
    uniform_done = measured     # measured times are not repriced by the cost model
    global _WORKER_COSTS
    _WORKER_COSTS = costs     # forked workers read it instead of unpickling the graph
    jobs = StageJobs(_stage_in_worker, _workers())
    try:
        for _ in range(MAX_EXACT_ROUNDS + 1):
            solution = stage_dp(L, cluster.num_nodes, cluster.devices_per_node, B, cost)
            todo = [key for key in keys(solution) if not _picked(choice, key)[1]]
            picks = [(key, _picked(choice, key)[0]) for key in todo]
            budget = None
            if not todo and not uniform_done:
                # the answer is exact: price the uniform partitions that might beat it, each
                # solve within ``UNIFORM_TIME_LIMIT``
                uniform_done = True
                picks = uniform_picks(solution.total * (1 + UNIFORM_MARGIN))
                todo = [key for key, _ in picks]
                budget = UNIFORM_TIME_LIMIT
            if not todo or measured:
                break
            round_picks = picks if budget is None else []
            costs.solve_stages([(k, i, shapes[j], view, flight, recompute)
                                for (k, i, j, flight), (view, _, recompute) in picks], jobs,
                               budget, next_round)
            for key, (view, _, recompute) in picks:
                k, i, j, flight = key
                latency, option = costs.exact(k, i, shapes[j], view, flight, recompute, budget)
                exact.setdefault(key, {})[view, recompute] = (
                    latency, (view, option, recompute) if math.isfinite(latency) else None)
        else:    # rounds spent: keep what was priced exactly, drop the optimistic guesses
            solution = stage_dp(L, cluster.num_nodes, cluster.devices_per_node, B,
                                lambda k, i, j, after: cost(k, i, j, after, guess=False))
    finally:
        jobs.close()
        log.info("pipeline search: %d stage solves guessed while a worker was idle, %d of "
                 "them asked for, %d stopped", jobs.guessed, jobs.guesses_used,
                 jobs.guesses_stopped)
    stages = []
    for key in keys(solution):
        picked, is_exact = _picked(choice, key)
        if is_exact:
            stages.append(picked)
        else:
            view, lean, recompute = picked
            stages.append((view, replace(costs.method.auto_sharding_option,
                                         parameters="sharded") if lean else None, recompute))
    return solution, stages, sum(len(v) for v in exact.values()), uniform_exact()


def _search_option(option: AutoShardingOption, budget: float | None) -> AutoShardingOption:
    """``option`` for a stage solve of the search: no unsimplified re-solve above
    ``SEARCH_RESOLVE_BELOW`` nodes and, with ``budget`` seconds (a uniform partition's
    stage, an alternative to the answer), its ILP time limit at most that and no
    alternating re-solve of repeated blocks (``AutoShardingOption.alternate_blocks``: on
    GPT-39B's 64-device row the slowest such stage, layers 0-1 with 4 micro-batches in
    flight, took 18.8 s with it and 10.1 s without, at the same latency)."""
    below = min(option.exact_below, SEARCH_RESOLVE_BELOW)
    if budget is None:
        return option if below == option.exact_below else replace(option, exact_below=below)
    limit = budget if option.time_limit is None else min(option.time_limit, budget)
    return replace(option, time_limit=limit, exact_below=below, alternate_blocks=False)


def _uniform_layouts(L: int, cluster: Cluster, shapes: list[tuple[int, int]]
                     ) -> list[tuple[int, int]]:
    """(stages, submesh index) of every uniform partition: ``stages`` dividing the
    layer count, each stage on the same submesh shape, ``stages`` of them tiling the
    cluster (a hand grid's pp and dp x tp devices per stage)."""
    return [(pp, j) for pp in range(1, L + 1) if L % pp == 0
            for j, (n, m) in enumerate(shapes) if n * m * pp == cluster.num_devices]


def _view_best(costs: _StageCosts, key: tuple, submesh: tuple[int, int], view: tuple,
               priced: dict) -> tuple[float, tuple, bool] | None:
    """The cheapest variant (kept or recomputed) of stage ``key`` on ``view``: (latency,
    (view, lean, recompute), exact?), exact where ``priced`` has it, else the additive
    estimate (optimistic where near fitting); None if no variant on ``view`` may fit."""
    k, i, _, flight = key
    best = None
    for (v, recompute), (latency, chosen) in _variants(costs, k, i, submesh, flight,
                                                       True).items():
        if v != view:
            continue
        if (v, recompute) in priced:
            latency, found = priced[v, recompute]
            if found is None:
                continue
            candidate = (latency, chosen, True)
        else:
            candidate = (latency, chosen, False)
        if best is None or candidate[0] < best[0]:
            best = candidate
    return best


def _picked(choice: dict, key: tuple) -> tuple[tuple, bool]:
    picked = choice[key]
    assert picked is not None, "the DP chose a stage with no plan"
    return picked


def _variants(costs: _StageCosts, k: int, i: int, submesh: tuple[int, int], flight: int,
              guess: bool) -> dict[tuple, tuple[float, tuple]]:
    """(view, recompute) -> (latency, (view, lean, recompute)) of the variants of layers
    k..i on ``submesh`` that fit by the additive estimate, or, with ``guess``, are within
    ``MEMORY_SLACK`` x the budget of fitting: the fastest such plan per variant."""
    limit = (MEMORY_SLACK if guess else 1.0) * costs.budget()
    out: dict[tuple, tuple[float, tuple]] = {}
    for latency, memory, view, lean, recompute in costs.candidates(k, i, submesh, flight):
        if memory <= limit and ((view, recompute) not in out or
                                latency < out[view, recompute][0]):
            out[view, recompute] = (latency, (view, lean, recompute))
    return out


def plan_pipeline(graph: OpGraph, cluster: Cluster, method: PipeshardParallel, *,
                  inputs: str = "global", measured: dict | None = None,
                  share_views: bool = True) -> PipelinePlan:
    """Alpa's PipeshardParallel plan of ``graph`` (one micro-batch) on ``cluster``.

    ``measured``: seconds per micro-batch of each ``LayerProbe.key`` timed on the devices
    (required by ``stage_option="profile"``, which otherwise plans like "auto").
    ``share_views``: views of one class share a layer's solve, and dominated views are
    skipped (``_StageCosts.prefetch``, ``searched_views``); off, every shardable view is
    solved (slow: the reference the sharing is tested against)."""
    start = time.perf_counter()
    layer = assign_layers(graph, method, cluster.num_devices)
    L = max(layer.values()) + 1
    B = method.num_micro_batches
    option = method.stage_option
    if option == "profile" and measured is None:
        raise ValueError("stage_option='profile' times layers on this job's devices: call "
                         "torchalpa.auto_parallel under torchrun (torchalpa.plan has no "
                         "devices to time on), or use stage_option='auto'")
    costs = _StageCosts(graph, layer, cluster, method, inputs, measured, share_views)
    notes: list[str] = []
    uniform: list[list[tuple]] = []
    recompute: list[bool] | None = None
    if isinstance(option, ManualStageOption):
        stages = _manual(option, L, cluster)
        recompute = list(option.recompute) if option.recompute else None
    elif isinstance(option, UniformStageOption):
        stages, recompute = _uniform(option, L, cluster, costs, B, method.pipeline_schedule)
    else:
        shapes = submesh_shapes(cluster.num_nodes, cluster.devices_per_node)
        costs.prefetch(shapes, workers=_workers(), max_in_flight=(
            min(B, L) if method.pipeline_schedule == "1f1b" else B))
        log.info("pipeline search: %d layer solves, %d more views priced with their "
                 "class's plan, in %.1fs", costs.solves, costs.repriced,
                 time.perf_counter() - start)
        try:
            solution, chosen, priced, uniform = _exact_search(costs, L, cluster, B,
                                                     method.pipeline_schedule, shapes)
        except ValueError as e:    # no stage fits: infeasible, like an ILP that finds none
            raise InfeasibleError(f"pipeline search on {cluster.num_nodes}x"
                                  f"{cluster.devices_per_node} devices with {B} micro-batches:"
                                  f" {e}") from e
        log.info("pipeline search: %d stage candidates priced exactly (%d stage solves)",
                 priced, costs.exact_solves)
        stages = [(s.layers, s.submesh, view, option)
                  for s, (view, option, _) in zip(solution.stages, chosen)]
        recompute = [r for _, _, r in chosen]
        notes += view_notes(shapes, costs.dims, share_views and
                            method.auto_sharding_option.allow_mixed_mesh_shape)
    searched = time.perf_counter()
    timed = [costs.range_seconds(k, i, view, submesh) for (k, i), submesh, view, _ in stages]
    plan = assemble_plan(graph, layer, stages, cluster, method, inputs,
                     stage_seconds=timed if all(t is not None for t in timed) else None,
                     known=costs.exact_plans, recompute=recompute, donor=costs.donated)
    plan = _fastest_of(plan, uniform, lambda alternative: assemble_plan(
        graph, layer, [st[:4] for st in alternative], cluster, method, inputs,
        known=costs.exact_plans, recompute=[st[4] for st in alternative],
        donor=costs.donated))
    log.info("pipeline plan: %d layers, %d stages, %d layer solves for the DP (%.1fs), "
             "stage plans %.1fs (%d moved from identical layers, %d exact solves answered "
             "from fewer in flight)", L, len(stages), costs.solves, searched - start,
             time.perf_counter() - searched, costs.transplanted, costs.reused_in_flight)
    return replace(plan, notes=plan.notes + tuple(notes), estimates=Estimates.from_dict(dict(
        plan.estimates, search_seconds=searched - start, layer_solves=costs.solves,
        layers_repriced=costs.repriced, stage_solves=costs.exact_solves,
        total_seconds=time.perf_counter() - start)))


def _fastest_of(plan: PipelinePlan, alternatives: list[list[tuple]], assemble
                ) -> PipelinePlan:
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
        if candidate.estimates["step_time_s"] < best.estimates["step_time_s"]:
            best = candidate
    if best is not plan:
        log.info("pipeline search: a uniform partition priced exactly simulates faster "
                 "(%.6g s) than the DP's answer (%.6g s): taken", best.estimates["step_time_s"],
                 plan.estimates["step_time_s"])
    return best


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
    signature = _layer_signatures(graph, layer, L)
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
                plan = assemble_plan(graph, layer, stages, room, method, inputs)
                probes.append(LayerProbe(key, l, plan, 1 if l > 0 else 0))
    return probes


def _workers() -> int:
    """Processes for independent solves: the cores this process may use."""
    import os
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _manual(option: ManualStageOption, L: int, cluster: Cluster) -> list:
    if option.forward_stage_layer_ids[-1][-1] != L - 1:
        raise ValueError(f"ManualStageOption covers layers 0..{option.forward_stage_layer_ids[-1][-1]}"
                         f" but the model has {L} layers (0..{L - 1})")
    used = sum(n * m for n, m in option.submesh_shapes)
    if used != cluster.num_devices:
        raise ValueError(f"ManualStageOption's submeshes use {used} devices, the cluster has "
                         f"{cluster.num_devices}")
    out = []
    for s, ids in enumerate(option.forward_stage_layer_ids):
        submesh = option.submesh_shapes[s]
        view = tuple(option.logical_shapes[s]) if option.logical_shapes else (submesh[0] * submesh[1],)
        opt = option.options[s] if option.options else None
        out.append(((ids[0], ids[-1]), submesh, view, opt))
    return out


def _uniform(option: UniformStageOption, L: int, cluster: Cluster, costs: _StageCosts,
             B: int, schedule: str) -> tuple[list, list[bool]]:
    S = option.num_stages or (cluster.num_nodes if cluster.num_nodes > 1 else 2)
    if cluster.num_devices % S or L < S:
        raise ValueError(f"uniform stages: {S} stages need {S} <= {L} layers and a device "
                         f"count ({cluster.num_devices}) they divide")
    per = cluster.num_devices // S
    submesh = (per // cluster.devices_per_node, cluster.devices_per_node) \
        if per >= cluster.devices_per_node else (1, per)
    bounds = [round(s * L / S) for s in range(S + 1)]
    out, recompute = [], []
    for s in range(S):
        k, i = bounds[s], bounds[s + 1] - 1
        flight = min(B, S - s) if schedule == "1f1b" else B
        _, chosen = costs.cost(k, i, submesh, flight)
        view, lean, again = chosen if chosen is not None else ((per,), False, False)
        sharding = replace(costs.method.auto_sharding_option, parameters="sharded") \
            if lean else None
        out.append(((k, i), submesh, view, sharding))
        recompute.append(again)
    return out, recompute


def _place(submeshes: list[tuple[int, int]], cluster: Cluster) -> list[tuple[int, ...]]:
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


def assemble_plan(graph: OpGraph, layer: dict[str, int], stages: list, cluster: Cluster,
              method: PipeshardParallel, inputs: str, stage_seconds: list | None = None,
              known: dict | None = None, recompute: list[bool] | None = None,
              donor=None) -> PipelinePlan:
    """The PipelinePlan of ``stages`` ((first, last layer), submesh, view, option), each
    stage planned exactly; ``known`` holds stage plans the search already solved, keyed
    (first, last, submesh, view, lean, in flight, recompute), reused when made for the
    same graph. ``recompute``: per stage, whether it checkpoints its activations (planned
    with one micro-batch in flight in what the others' inputs leave of the budget)."""
    recompute = list(recompute) if recompute else [False] * len(stages)
    stage_of_layer = {}
    for s, ((k, i), _, _, _) in enumerate(stages):
        for l in range(k, i + 1):
            stage_of_layer[l] = s
    node_stage = {n: stage_of_layer[l] for n, l in layer.items()}
    ranks = _place([st[1] for st in stages], cluster)
    subs = [stage_subgraph(graph, node_stage, s) for s in range(len(stages))]
    # each stage must fit with the micro-batches its schedule keeps in flight, as the DP
    # and the estimates count them
    schedule = SCHEDULES[method.pipeline_schedule](len(stages), method.num_micro_batches)
    received = [received_bytes(graph, lambda name, s=s: node_stage[name] == s)
                if recompute[s] else 0.0 for s in range(len(stages))]
    requests = [_stage_request(sub.graph, _submesh_cluster(cluster, submesh).logical_mesh(view),
                               method, option, inputs, in_flight(schedule[s]),
                               received[s] if recompute[s] else None)
                for s, (sub, (_, submesh, view, option)) in enumerate(zip(subs, stages))]
    plans: list = [None] * len(stages)
    for s, ((k, i), submesh, view, option) in enumerate(stages):
        lean = option is not None and option.parameters == "sharded"
        plan = (known or {}).get((k, i, submesh, view, lean, in_flight(schedule[s]),
                                  recompute[s]))
        if plan is not None and (option is None or lean) and \
                plan.graph_fingerprint == subs[s].graph.fingerprint():
            plans[s] = plan
        elif donor is not None and (option is None or lean):
            plans[s] = donor(k, i, submesh, view, lean, in_flight(schedule[s]), recompute[s],
                             requests[s])
    todo = [s for s in range(len(stages)) if plans[s] is None]
    for s, plan in zip(todo, _map(_plan_stage, [requests[s] for s in todo], _workers())):
        plans[s] = plan
    stage_plans, transfers = [], []
    for s, ((k, i), submesh, _view, _option) in enumerate(stages):
        sub, plan = subs[s], plans[s]
        stage_plans.append(StagePlan(index=s, layers=tuple(range(k, i + 1)), submesh=submesh,
                                     ranks=ranks[s], plan=plan, recompute=recompute[s]))
        for ref in sub.sends:
            for t in sorted({node_stage[c] for c in graph.consumers(ref.node)} - {s}):
                transfers.append(Transfer(producer=ref.node, index=ref.index, src_stage=s,
                                          dst_stage=t, phase=graph.node(ref.node).phase,
                                          bytes=graph.spec(ref).nbytes,
                                          once_per_step=_once_per_step(graph, ref, node_stage,
                                                                       t)))
    transfers += _owner_transfers(graph, node_stage, transfers)
    return PipelinePlan(mesh_shape=(cluster.num_nodes, cluster.devices_per_node),
                        stages=tuple(stage_plans), transfers=tuple(transfers),
                        node_stage=node_stage, num_micro_batches=method.num_micro_batches,
                        schedule=method.pipeline_schedule,
                        estimates=_estimates(stage_plans, transfers, method, cluster,
                                             stage_seconds, received),
                        method=method.to_dict(), graph_fingerprint=graph.fingerprint())


def _once_per_step(graph: OpGraph, ref, part: dict, dst: int) -> bool:
    """Whether ``ref`` can cross to stage (or layer) ``dst`` of ``part`` once per step
    instead of per micro-batch: a parameter, or a gradient part ``dst`` only adds into a
    parameter's gradient (GPT's head contributing to its tied embedding's gradient),
    which may be summed over the micro-batches first."""
    if graph.node(ref.node).kind == "param":
        return True
    if graph.node(ref.node).phase != "backward":
        return False
    readers = [c for c in graph.consumers(ref.node) if part[c] == dst]
    if len(readers) != 1:
        return False
    add = graph.node(readers[0])
    return (add.op == "aten.add.Tensor" and len(add.operands) == 2
            and sum(1 for o in add.operands if o == ref) == 1
            and not graph.consumers(add.name)
            and any(r == ValueRef(add.name, 0) for _, r in graph.outputs.grads))


def _stage_request(graph: OpGraph, mesh, method: PipeshardParallel, option, inputs: str,
                   flight: int, received: float | None) -> tuple:
    """What ``_plan_stage`` plans a stage from; a recomputed stage (``received``: the
    bytes each other micro-batch in flight keeps) with one micro-batch in flight and the
    budget the others leave (``passes/stage_remat.py``)."""
    if received is None:
        return graph, mesh, method.intra_op_method(option), inputs, flight
    budget = method.auto_sharding_option.memory_budget_per_device or mesh.memory_per_device
    lowered = recompute_option(option or method.auto_sharding_option, budget, received, flight)
    if lowered is None:
        raise InfeasibleError(f"a recomputed stage keeps {flight - 1} micro-batches' inputs "
                              f"of {received / 2**30:.2f} GiB each, more than the "
                              f"{budget / 2**30:.1f} GiB budget per device")
    return graph, mesh, method.intra_op_method(lowered), inputs, 1


def _plan_stage(request: tuple):
    graph, mesh, method, inputs, flight = request
    return plan_intra_op(graph, mesh, method, inputs=inputs, in_flight=flight,
                         blocks=graph.meta.get("repeated_blocks") or None)


def _map(fn, items: list, workers: int) -> list:
    """``[fn(x) for x in items]``, in forked processes when there are several of each.

    Forking a process that runs JAX (a JAX program planned through the StableHLO
    frontend) can deadlock the child on a lock one of XLA's threads held, and the
    workers read state the fork hands them (``_WORKER_COSTS``): with JAX loaded the
    items are solved here, one after another (slower, same results)."""
    if workers <= 1 or len(items) < 2 or not can_fork():
        return [fn(x) for x in items]
    import multiprocessing as mp
    with mp.get_context("fork").Pool(min(workers, len(items))) as pool:
        return pool.map(fn, items, chunksize=1)


def _owner_transfers(graph: OpGraph, node_stage: dict, have: list[Transfer]) -> list[Transfer]:
    """Gradients (and buffer updates) made outside their owner's stage go to the owner."""
    known = {(t.producer, t.index, t.dst_stage) for t in have}
    params = graph.params
    buffers = {n.target: n.name for n in graph if n.kind == "buffer"}
    out = []
    for leaf, ref in [(params[f], r) for f, r in graph.outputs.grads] + \
            [(buffers[f], r) for f, r in graph.outputs.buffer_updates]:
        src, dst = node_stage[ref.node], node_stage[leaf]
        if src != dst and (ref.node, ref.index, dst) not in known:
            known.add((ref.node, ref.index, dst))
            out.append(Transfer(ref.node, ref.index, src, dst, graph.node(ref.node).phase,
                                graph.spec(ref).nbytes))
    return out


def _estimates(stages: list[StagePlan], transfers: list[Transfer], method, cluster,
               stage_seconds: list | None = None, received: list[float] | None = None
               ) -> Estimates:
    S, B = len(stages), method.num_micro_batches
    link = cluster.inter_node_bandwidth if cluster.num_nodes > 1 else cluster.intra_node_bandwidth
    # what a stage pays once per step (its gradients' final resharding, the optimizer)
    # runs after its last backward, not with every micro-batch
    once_s = [s.plan.estimates.get("once_per_step_s") or 0.0 for s in stages]
    step = list(stage_seconds) if stage_seconds is not None else \
        [s.plan.estimates["step_time_s"] - o for s, o in zip(stages, once_s)]
    forward = [t * FORWARD_SHARE for t in step]   # backward is about twice forward's work
    # a recomputed stage runs its forward again in backward
    backward = [t - f + (f if s.recompute else 0.0) for t, f, s in zip(step, forward, stages)]
    step = [recompute_seconds(t) if s.recompute else t for t, s in zip(step, stages)]
    send = [sum(t.bytes for t in transfers if t.src_stage == s and t.phase == "forward"
                and not t.once_per_step) / link for s in range(S)]
    schedule = SCHEDULES[method.pipeline_schedule](S, B)
    timeline = simulate(schedule, forward, backward, send)
    # once per step: parameters before the first micro-batch, summed gradient parts
    # after the last
    once = sum(t.bytes for t in transfers if t.once_per_step) / link
    total = max(max(e for _, _, _, e in stage) + o for stage, o in zip(timeline, once_s)) + once
    memory = [(recompute_memory if s.recompute else in_flight_bytes)(
        s.plan.estimates["model_state_bytes_per_device"],
        s.plan.estimates["activation_bytes_per_device"],
        (received or [0.0] * S)[n] if s.recompute else
        s.plan.estimates["saved_activation_bytes_per_device"],
        in_flight(schedule[n])) for n, s in enumerate(stages)]
    budget = method.auto_sharding_option.memory_budget_per_device or cluster.memory_per_device
    return Estimates(step_time_s=total, max_stage_s=max(step), stage_step_s=step,
                     stage_times="measured" if stage_seconds is not None else "cost model",
                     alpa_objective_s=sum(step) + (B - 1) * max(step),
                     memory_per_device_bytes=max(memory), stage_memory_bytes=memory,
                     timeline=timeline,
                     # recorded for reports and pictures
                     memory_budget_per_device_bytes=float(budget) if budget else None)
