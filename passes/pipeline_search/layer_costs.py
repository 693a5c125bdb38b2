"""Per-layer estimates: each distinct layer planned by the intra-op ILP on every searched view.

The stage DP adds up layers: a range of layers costs the sum of its layers' step times,
and its memory follows from theirs (``stage_memory``). So every layer is planned alone on
every view of every submesh (``passes/pipeline_search/submesh_views.py``), once per distinct layer
(identical layers share one solve through their structural signature,
``passes/pipeline_search/layer_cache.py``), the layer's boundary values free to stay in any layout. Each
layer has two variants per view: the fastest plan, and a lean one with its parameters
sharded for where the fastest does not fit.

With ``share_views`` the views of one ``view_class`` share one ILP solve: the class's
first view is solved and the others price that plan (``passes/pipeline_search/view_classes.py``). The
solves are independent jobs, run ``workers`` at a time in forked processes
(``passes/pipeline_search/stage_jobs.py::fork_map``).

With ``stage_option="profile"``, ``measured`` gives each distinct layer's seconds on the
devices; the model's estimate then only decides memory and a lean plan's extra gathers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torchalpa.core.cluster import LogicalMesh, Submesh, View
from torchalpa.core.opgraph import GraphOutputs, OpGraph
from torchalpa.core.options import ShardParallel
from torchalpa.core.plan import Plan
from torchalpa.core.plan_records import Estimates, known
from torchalpa.core.switches import PassSwitches
from torchalpa.passes.pipeline_search.layer_cache import SolveCache
from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
from torchalpa.passes.pipeline_search.search_problem import SearchProblem
from torchalpa.passes.pipeline_search.stage_jobs import fork_map
from torchalpa.passes.pipeline_search.submesh_views import (
    searched_views,
    shardable_views,
    tensor_dims,
)
from torchalpa.passes.pipeline_search.view_classes import reprice, view_class
from torchalpa.passes.pricing.memory import in_flight_bytes
from torchalpa.passes.sharding.ilp import InfeasibleError
from torchalpa.passes.sharding.intra_op import plan_intra_op

__all__ = ["Estimate", "estimate_of", "micro_batch_seconds", "stage_memory", "LayerCosts"]

Member = tuple[View, Submesh]        # a view of a submesh

@dataclass
class Estimate:
    """A plan's figures per device, as the stage estimates add them up."""

    seconds: float
    state: float
    activations: float     # peak of one micro-batch
    saved: float           # what one micro-batch holds between its forward and backward
    once_share: float = 0.0   # of ``seconds``: its share of what runs once per step


def micro_batch_seconds(estimates: Estimates, num_micro_batches: int) -> float:
    """A stage plan's seconds per micro-batch in a pipeline of ``num_micro_batches``: what
    it runs for every micro-batch, plus its share of what it runs once per step
    (``once_per_step_s``: the gradients' final resharding, the optimizer), so that Alpa's
    objective (the sum of the stages' latencies plus ``B - 1`` times the slowest) counts
    those once, not ``B`` times."""
    once = estimates.once_per_step_s or 0.0
    # a stage reduces its gradients after its last backward: none hidden behind it
    hidden = estimates.hidden_gradient_s or 0.0
    return known(estimates.step_time_s) - once + (once + hidden) / num_micro_batches


def estimate_of(plan: Plan | None, num_micro_batches: int) -> Estimate | None:
    """``plan``'s ``Estimate`` in a pipeline of ``num_micro_batches`` (its seconds per
    micro-batch: ``micro_batch_seconds``); None for no plan: nothing fits."""
    if plan is None:
        return None
    e = plan.estimates
    seconds = micro_batch_seconds(e, num_micro_batches)
    return Estimate(seconds, known(e.model_state_bytes_per_device),
                    known(e.activation_bytes_per_device),
                    known(e.saved_activation_bytes_per_device),
                    seconds - (known(e.step_time_s) - (e.once_per_step_s or 0.0)))


def stage_memory(parts: list[Estimate], in_flight_batches: int) -> float:
    """Bytes per device of layers run as one stage: each layer's saved activations, one
    layer's working set above that, and the saved activations of every micro-batch in
    flight (summing per-layer peaks would count every layer's working set at once).

    The step's end (the optimizer step, ``passes/pricing/step_end.py``), which the exact
    stage solves count, is left out: this filter must stay at or below what they count,
    or it refuses stages that fit, and the layers' own ends do not add up to a bound of
    the stage's. Each layer's end holds its parameters, gradients and states (those add
    up) and the update's temporaries, which add up only where the stage steps with
    ``foreach``: tensor by tensor (on CPU ranks, for groups too large for ``foreach``:
    ``core/optimizer_step.py``) the stage holds the copies of its one largest block, not
    one per layer, and whether a stage's group is small enough depends on all its layers
    at once. Without it the filter stays a bound; with gradient sums over micro-batches
    (every pipeline step of more than one) a layer's states already hold its gradients,
    so the end exceeds what is counted here only by the temporaries, less the
    activations the stage holds in flight, and the exact solve catches a stage it
    does not fit."""
    saved = sum(p.saved for p in parts)
    peak = saved + max(p.activations - p.saved for p in parts)
    return in_flight_bytes(sum(p.state for p in parts), peak, saved, in_flight_batches)


class LayerCosts:
    """Each layer's ``Estimate`` on each searched view, solved once per structure and kept
    in ``cache`` (see module doc), pricing work kept in ``memo``. ``solves`` counts ILP
    solves, ``repriced`` the views priced with their class's plan instead."""

    def __init__(self, problem: SearchProblem, cache: SolveCache, memo: PricingMemo,
                 measured: dict | None = None, share_views: bool = True):
        self.problem, self.cache, self.memo = problem, cache, memo
        self.measured = measured   # (signature, view, submesh) -> seconds, when profiled
        self.share_views = share_views
        self.solves = 0
        self.repriced = 0
        self.copied = 0       # views given a replicated-alike view's estimates
        self._layer_graphs: dict[int, OpGraph] = {}
        self._layer_rules: dict[int, dict] = {}     # per layer: node -> its sharding rule
        self._layer_dims: dict[str, frozenset[int]] = {}   # layer signature -> its dims

    def views(self, submesh: Submesh) -> list[View]:
        """The logical views of ``submesh`` the search plans layers on: ``searched_views``
        (``shardable_views`` when ``share_views`` is off)."""
        if not self.share_views:
            return shardable_views(submesh, self.problem.dims)
        return searched_views(submesh, self.problem.dims,
                              self.problem.method.auto_sharding_option.allow_mixed_mesh_shape)

    def prefetch(self, submeshes: list[Submesh], workers: int, max_in_flight: int) -> None:
        """Price every distinct layer on every searched view up front, ``workers`` at a
        time (the DP asks for all of them; each job is independent). With ``share_views``,
        views of one ``view_class`` share one ILP solve: the class's first view is solved,
        the others price that plan, and the lean (sharded-state) variants price it with
        its parameters sharded (``passes/pipeline_search/view_classes.py``). Without it, every view is
        solved, and the lean variants follow by ILP for the views where the fastest plans
        may not fit."""
        views = [(view, submesh) for submesh in submeshes for view in self.views(submesh)]
        if self.share_views:
            self._solve_classes(views, workers)
            return
        layers = range(self.problem.num_layers)
        self._solve_all([(l, (member,), False) for member in views for l in layers], workers)
        tight = [member for member in views if not self._fits_fastest(member, max_in_flight)]
        self._solve_all([(l, (member,), True) for member in tight for l in layers], workers)

    def _fits_fastest(self, member: Member, in_flight_batches: int) -> bool:
        """Whether all layers' fastest plans on ``member``, as one stage with
        ``in_flight_batches`` micro-batches in flight, fit the budget."""
        view, submesh = member
        parts = [self.cache.peek(self._key(l, view, submesh, False))
                 for l in range(self.problem.num_layers)]
        return all(p is not None for p in parts) and \
            stage_memory(parts, in_flight_batches) <= self.problem.budget()

    def _solve_classes(self, views: list[Member], workers: int) -> None:
        """Every distinct layer on ``views``: one job per (layer, class of views), the
        class's first view solved and its plan priced on the rest."""
        requests = []
        for l in range(self.problem.num_layers):
            classes: dict[object, list[Member]] = {}
            for view, submesh in views:
                classes.setdefault(self.view_class(view, submesh, l), []).append(
                    (view, submesh))
            for members in classes.values():
                todo = tuple((view, submesh) for view, submesh in members
                             if self._key(l, view, submesh, False) not in self.cache
                             or self._key(l, view, submesh, True) not in self.cache)
                if todo:
                    requests.append((l, todo, None))
        self._solve_all(requests, workers)

    def view_class(self, view: View, submesh: Submesh, l: int | None = None):
        """The ``view_class`` of ``view`` on ``submesh`` for layer ``l``'s dims (every dim
        of the step's values when None). A layer's strategies are its own values' splits,
        so only the dims it holds decide which views offer it the same ones: the vocabulary
        of the embedding does not part a decoder layer's views (LLaMA-3-70B on 16 x 8: 3, 5,
        6, 7 ... nodes divide no dim of a decoder layer, and 3 divides the vocabulary)."""
        mesh = self.problem.mesh(submesh, view)
        if l is None or not PassSwitches.current().layer_classes:
            return view_class(mesh, self.problem.dims)
        return view_class(mesh, self.layer_dims(l))

    def layer_dims(self, l: int) -> frozenset[int]:
        """Every dim size of layer ``l``'s own graph (``layer_graph``), once per structure."""
        signature = self.problem.signature[l]
        dims = self._layer_dims.get(signature)
        if dims is None:
            dims = self._layer_dims[signature] = tensor_dims(self.layer_graph(l))
        return dims

    def _solve_all(self, requests: list[tuple], workers: int) -> None:
        """Run ``solve_members`` jobs (layer, (view, submesh) members, lean) and store
        each member's estimates."""
        todo = {}
        for l, members, lean in requests:
            todo.setdefault((self.problem.signature[l], members, lean), (l, members, lean))
        for l in {args[0] for args in todo.values()}:
            self.layer_graph(l)  # made here, so that forked workers inherit them
        # largest meshes first so the workers stay busy to the end
        jobs = sorted(todo.values(), key=lambda args: -math.prod(args[1][0][0]))
        solves, repriced, copied = self.solves, self.repriced, self.copied
        results = fork_map(self.solve_members, jobs, workers)
        for (l, _members, _), (estimates, counts) in zip(jobs, results):
            for (view, submesh, lean), estimate in estimates.items():
                self.cache.put(self._key(l, view, submesh, lean), estimate)
            solves += counts[0]    # workers counted theirs in their own copies
            repriced += counts[1]
            copied += counts[2]
        self.solves, self.repriced, self.copied = solves, repriced, copied

    def solve_members(self, job: tuple[int, tuple[Member, ...], bool | None]
                      ) -> tuple[dict[tuple, Estimate | None], tuple[int, int, int]]:
        """Layer ``l`` on the first of ``members`` (views of one class) by the ILP, and
        on each other one by pricing that plan there; a member the plan does not carry
        over to (not expected within a class) is solved by its own ILP. ``lean`` None:
        both variants, the lean ones priced from the fastest plan. Returns the estimates
        by (view, submesh, lean) and (ILP solves, views priced without one, views given a
        replicated-alike view's estimates, ``replicated_alike``)."""
        l, members, lean = job
        solves, repriced, copied = self.solves, self.repriced, self.copied
        out: dict[tuple, Estimate | None] = {}
        (first_view, first_submesh) = members[0]
        first = self._layer_plan(l, first_view, first_submesh, bool(lean))
        variants = (False, True) if lean is None else (lean,)
        for view, submesh in members:
            same = (view, submesh) != members[0] and \
                self.replicated_alike(l, members[0], (view, submesh))
            self.copied += len(variants) if same else 0
            for variant in variants:
                if same:
                    out[(view, submesh, variant)] = out[(first_view, first_submesh, variant)]
                    continue
                plan = first if (view, submesh) == members[0] and variant == bool(lean) \
                    else self._priced(l, first, view, submesh, variant)
                out[(view, submesh, variant)] = estimate_of(
                    plan, self.problem.method.num_micro_batches)
        return out, (self.solves - solves, self.repriced - repriced, self.copied - copied)

    def replicated_alike(self, l: int, a: Member, b: Member) -> bool:
        """Whether views ``a`` and ``b`` of one class differ only in the sizes of axes
        that divide no dim of layer ``l``: every plan of the layer then replicates over
        those axes (each device there repeats the same work, no collective runs on them),
        so it costs the same on both, and ``a``'s estimates are ``b``'s without pricing
        (``PassSwitches.copy_replicated``). On 128 nodes most node counts are such (an odd factor
        divides no dim of a LLaMA layer): their views are then not priced one by one."""
        switches = PassSwitches.current()
        if not switches.copy_replicated:
            return False
        ma, mb = self.problem.mesh(a[1], a[0]), self.problem.mesh(b[1], b[0])
        if len(ma.shape) != len(mb.shape):
            return False
        cls = view_class(ma, self.layer_dims(l) if switches.layer_classes else self.problem.dims)
        return all(x == y or not cls.axes[axis][2]
                   for axis, (x, y) in enumerate(zip(ma.shape, mb.shape)))

    def _priced(self, l: int, plan: Plan | None, view: View, submesh: Submesh,
                lean: bool) -> Plan | None:
        """``plan`` of layer ``l`` priced on ``view`` (made lean if ``lean``), or solved
        there if it does not carry over."""
        found = None if plan is None else reprice(
            self.layer_graph(l), plan, self._layer_mesh(view, submesh),
            self._layer_method(lean), self.problem.inputs, relayout_parameters=lean,
            rules=self._layer_rules.setdefault(l, {}), memo=self.memo,
            step_micro_batches=self.problem.method.num_micro_batches)
        if found is None:
            return self._layer_plan(l, view, submesh, lean)
        self.repriced += 1
        return found

    def layer_estimate(self, l: int, view: View, submesh: Submesh, lean: bool
                       ) -> Estimate | None:
        """Layer ``l``'s ``Estimate`` on ``view`` (lean: parameters sharded), None if no
        plan fits; its time measured where ``measured`` has it."""
        estimate = self.cache.get(self._key(l, view, submesh, lean), lambda: estimate_of(
            self._layer_plan(l, view, submesh, lean), self.problem.method.num_micro_batches))
        timed = None if self.measured is None else \
            self.measured.get((self.problem.signature[l], view, submesh))
        if estimate is None or timed is None:
            return estimate
        # measured time of the fastest plan; a lean plan adds what the model says its
        # extra gathers cost
        extra = 0.0
        if lean:
            fastest = self.layer_estimate(l, view, submesh, False)
            extra = max(0.0, estimate.seconds - fastest.seconds) if fastest else 0.0
        return replace(estimate, seconds=timed + extra)

    def solved_estimate(self, l: int, view: View, submesh: Submesh, lean: bool
                        ) -> tuple[bool, Estimate | None]:
        """Whether layer ``l`` was solved on ``view`` already, and its ``Estimate`` there
        (None: no plan fits); nothing is solved here (what ``layer_bound.py`` reads)."""
        key = self._key(l, view, submesh, lean)
        return (True, self.cache.peek(key)) if key in self.cache else (False, None)

    def range_seconds(self, k: int, i: int, view: View, submesh: Submesh) -> float | None:
        """Measured seconds of layers k..i on a view, if every one was timed."""
        if self.measured is None:
            return None
        parts = [self.measured.get((self.problem.signature[l], view, submesh))
                 for l in range(k, i + 1)]
        timed = [p for p in parts if p is not None]
        return sum(timed) if len(timed) == len(parts) else None

    def layer_graph(self, l: int) -> OpGraph:
        """Layer ``l`` alone as a graph, its boundary values free to stay in any layout
        (priced per stage instead); made once per layer and reused on every view."""
        sub = self._layer_graphs.get(l)
        if sub is None:
            sub = self.problem.stage_graph(l, l)
            sub = self._layer_graphs[l] = OpGraph(
                list(sub), GraphOutputs(loss=sub.outputs.loss, grads=sub.outputs.grads,
                                        buffer_updates=sub.outputs.buffer_updates), sub.meta)
        return sub

    def _key(self, l: int, view: View, submesh: Submesh, lean: bool) -> tuple:
        return ("layer", self.problem.signature[l], view, submesh, lean, self.share_views,
                self.problem.context)

    def _layer_mesh(self, view: View, submesh: Submesh) -> LogicalMesh:
        return replace(self.problem.mesh(submesh, view), memory_per_device=None)

    def _layer_method(self, lean: bool) -> ShardParallel:
        # an estimate: the simplified ILP (shared block decisions, merged followers, no
        # alternating layers) is within a few percent of the unsimplified one at a fifth
        # of the time; the stages the DP picks are priced by their own ILP, followers
        # freed and layers alternating where that pays
        method = self.problem.method
        option = replace(method.auto_sharding_option, exact_below=0, free_followers_below=0,
                         free_followers_near_budget=0,
                         alternate_blocks=False, **({"parameters": "sharded"} if lean else {}))
        return method.intra_op_method(option)

    def _layer_plan(self, l: int, view: View, submesh: Submesh, lean: bool) -> Plan | None:
        """Layer ``l``'s own intra-op plan on ``view`` (None if none exists)."""
        sub = self.layer_graph(l)
        self.solves += 1
        try:
            return plan_intra_op(sub, self._layer_mesh(view, submesh), self._layer_method(lean),
                                 inputs=self.problem.inputs,
                                 blocks=sub.meta.get("repeated_blocks") or None,
                                 memo=self.memo,
                                 step_micro_batches=self.problem.method.num_micro_batches)
        except InfeasibleError:
            return None
