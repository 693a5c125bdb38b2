"""``AutoParallel``: the planner chooses the method, the checkpointing and the micro-batches.

A candidate is one way to run the step: an intra-op plan or a pipeline, with one
activation-checkpointing mode and one micro-batch count (a divisor of the batch). The
search

1. captures the step once at the whole batch and derives each checkpointing variant
   from that capture (``frontends/block_remat.py``, no second trace);
2. bounds every candidate without a solver (``passes/pricing/bounds.py``): memory per device
   (everything split over every device; a pipeline's first stage also holds its
   micro-batches in flight) and step time (every op at its roofline over every device;
   a pipeline's stages issue only their own ops, so its host time counts split over
   as many stages as the step has layers; a pipeline of S >= 2 stages also pays its
   fill and drain, ``(k + S - 1) / k``);
   candidates that cannot fit are refused there;
3. solves the rest in the order of their time bounds -- each micro-batch size derived
   from that capture too (``frontends/rebatch.py``: the first one checked by records of
   the step's ops at both batch sizes, ``frontends/rebatch_check.py``, or where those
   cannot vouch traced as well and the two compared; traced where they differ or the
   derivation cannot be sure) -- until
   the next bound cannot beat the best plan by more than the tolerance (a plan is
   always found first when any fits). Once a plan is in hand, a pipeline candidate is
   also bounded by its stages before its layer ILPs (``_Search.stage_bound``,
   ``passes/pipeline_search/shape_bound.py``: the fill and drain of any cut of its
   layers, each stage's launches, kernel floors and host time, its states on its
   devices, from its own capture) and not solved where that cannot beat the plan by more
   than the tolerance either; and where that bound lets it through, its search stops
   after its layer ILPs, before any stage ILP, when its layers' own plans bound it
   (``passes/pipeline_search/layer_bound.py``) at what cannot beat the plan by more than
   the tolerance. A checkpointing intra-op candidate is bounded then by the linear
   relaxations of its views' problems (``relaxed_bound.py``: they price the collectives
   the roofline leaves out) and not solved where the least of them cannot beat the plan
   by more than the tolerance either. The search is bounded by work (the candidates'
   bounds, the solver's node limit ``AutoShardingOption.max_nodes``), not by seconds,
   so the same job gives the same plan on any machine at any load;
   ``time_budget_s`` is only a safety net, and when it fires the plan's notes say so
   (``CLOCK_NOTE``) and nothing it cut short is cached. Where a candidate's memory is
   tight, its ILPs stop within the tolerance (HiGHS' relative gap: near a binding memory
   row HiGHS may otherwise spend minutes proving a losing view optimal), and the views
   that could win are solved again at the solver's own gap (``_Search.polish``).
   A candidate is also dominated, and skipped, by a plan of its kind that fits with room
   to spare (``ROOM``): more checkpointing, (intra-op) more micro-batches, or gathering
   parameters again in backward (ZeRO-3, FSDP's reshard after forward) only adds work to
   every plan, and what it buys -- memory -- that plan did not need. The same two rules
   settle single views (logical meshes) of an intra-op candidate before its ILPs
   (``settled_views``): a view where a candidate alike but recomputing more did not fit,
   or where one it only adds work to fits with room to spare, is not solved. The views
   left are solved at once in forked processes, one per core (``plan_graph(workers=)``),
   each bounded by the same work, so the plan is the one solving them in turn gives.
   Each candidate's ILP on a view starts with the values the candidates before found
   read twice alike there priced once per layout (``SearchSwitches.seed_sharing``),
   sparing the solve that would find them again. A view with no plan within the budget
   is an answer, its least memory unsaid (``intra_op.least_memory_unsaid``: near the
   budget those ILPs cost more than the one that failed); a view whose memory floor is
   above the budget (``passes/sharding/view_floor.py``: every plan holds more at some
   point) gives that answer before any ILP, and the notes count such views.

On one node the candidates are intra-op plans; pipelines there are the fallback when no
intra-op plan fits (or what ``AutoParallel(pipeline=True)`` asks for): within a node the
devices share fast links, so what a pipeline saves -- collectives -- is small, and its
search costs far more than an intra-op plan (on a 4-layer MLP on 4 CPU ranks, 15-30 s for
a plan 0.2 % faster). On several nodes the pipeline search itself weighs one stage
over the whole cluster (an intra-op plan) against cuts at node boundaries, so pipelines
are the candidates there, tried in the order of their bound times the bubble of a cut
at every node boundary, ``(k + S - 1) / k``: enough micro-batches first.

The ILP picks each view's plan by its objective, which does not price the overlap the
step's estimate prices; so the layout published FSDP / ZeRO runs use (``dp_layout.py``:
batch over every device, parameters sharded) is also solved, a restricted ILP, for the
intra-op candidates planned whose bounds let it beat the best (``weigh_layouts``), and on
several nodes is a candidate kind of its own beside the pipelines; the lower estimate is
kept.

The plan it returns records the concrete method (``plan.method``: a ShardParallel or
PipeshardParallel record, with ``remat`` and ``num_micro_batches``), and its notes say
what was chosen, what came second and what was refused, with their estimates or bounds.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import torch

from torchalpa.core.calls import CallSignature
from torchalpa.core.choice_notes import CHOSEN, RUNNER_UP, TRIED, describe_candidate
from torchalpa.core.cluster import Cluster, LogicalMesh
from torchalpa.core.options import (
    OPTIMIZER_STATES,
    AutoParallel,
    PipeshardParallel,
    ShardParallel,
    parse_remat,
)
from torchalpa.core.plan import PipelinePlan, Plan
from torchalpa.core.plan_check import check_step_dtypes
from torchalpa.core.plan_records import known
from torchalpa.core.progress import left, step
from torchalpa.core.switches import SearchSwitches
from torchalpa.core.units import format_bytes
from torchalpa.frontends.rebatch import listed as _listed
from torchalpa.parallel import dp_layout
from torchalpa.parallel.offload import host_memory_shortfall, with_offload
from torchalpa.parallel.workflow import capture_examples, capture_step

if TYPE_CHECKING:
    from torchalpa.frontends.torch_export import Capture

__all__ = ["Candidate", "Attempt", "NothingFitsError", "search_method", "SearchSession",
           "batch_size", "AutoResolver", "AutoTarget"]

log = logging.getLogger("torchalpa")

ROOM = 0.9
"""A plan whose peak is below this fraction of the budget did not bend to fit it."""

SETTLED = "views settled without an ILP: "
"""How an attempt's detail begins when its views were settled without an ILP."""


STAGE_BOUND = "cannot beat "
"""How an attempt's detail begins when its stages' bound refused it (``stage_bound``)."""

RELAXED_BOUND = "its views' linear relaxations bound it at "
"""How an attempt's detail begins when its views' LP bounds refused it
(``relaxed_bound.py``)."""

LAYER_BOUND = "bounded by its layers' own plans at "
"""How an attempt's detail begins when its layers' own plans (or those of a candidate
that recomputes less) bounded it above the best plan in hand
(``passes/pipeline_search/layer_bound.py``)."""


@dataclass(frozen=True)
class Candidate:
    """One way to run the step, with what it must at least cost."""

    kind: str                   # "intra-op" or "pipeline"
    remat: str
    num_micro_batches: int
    bound_s: float              # step time no plan of this candidate can beat
    memory_bound: float         # bytes per device no plan of it can go below
    rank_s: float = 0.0         # what it is expected to take (the order candidates are tried)
    regather: bool = False      # parameters gathered again in backward (ZeRO-3, FSDP)
    exact: bool = True          # False: bounds of the lightest checkpointing mode's capture
    # (sound for time: recomputing only adds work; its own are computed when it is reached)

    def describe(self) -> str:
        return describe_candidate(self.kind, self.remat, self.num_micro_batches, self.regather)


@dataclass(frozen=True)
class PipelineBounds:
    """A pipeline candidate's step time without a solver: the bound no plan of it beats
    (``StepProfile.pipeline_step_seconds`` with a stage per layer), and the same figure
    for the stages the search's order assumes (``_pipeline_stages``)."""

    bound_s: float
    assumed_s: float


@dataclass(frozen=True)
class Attempt:
    """What became of a candidate: planned (with its estimate) or why not."""

    candidate: Candidate
    outcome: str   # planned | does not fit | over the budget | refused by bound | not needed
    #                | dominated | no time
    step_s: float | None = None
    memory: float | None = None
    seconds: float = 0.0
    detail: str = ""

    def line(self) -> str:
        c = self.candidate
        if self.outcome == "planned":
            return (f"{c.describe()}: est {self.step_s:.4g} s/step, "
                    f"{format_bytes(self.memory or 0)} per device ({self.seconds:.1f} s)")
        if self.outcome == "refused by bound":
            return (f"{c.describe()}: refused, needs at least "
                    f"{format_bytes(c.memory_bound)} per device (a bound)")
        if self.outcome == "not needed" and self.detail:
            return f"{c.describe()}: not planned, {self.detail}"
        if self.outcome == "not needed":
            return f"{c.describe()}: not planned, cannot beat {c.bound_s:.4g} s/step (a bound)"
        if self.outcome == "dominated":
            return (f"{c.describe()}: not planned, only adds work to {self.detail}, which fits "
                    "with room to spare")
        if self.outcome == "no time":
            return (f"{c.describe()}: not planned, time budget spent (bound "
                    f"{c.bound_s:.4g} s/step)")
        return f"{c.describe()}: {self.outcome}{': ' + self.detail if self.detail else ''}"


class NothingFitsError(ValueError):
    """No candidate fits the memory budget; the message lists what was tried and what
    would fit. A ValueError, like ``passes.sharding.ilp.InfeasibleError``."""

    def __init__(self, message: str, attempts: Sequence[Attempt]):
        super().__init__(message)
        self.attempts = tuple(attempts)


def batch_size(tensors: Sequence) -> int:
    """The batch the step is captured for: the greatest common divisor of the inputs'
    dim 0 (what micro-batches may divide)."""
    sizes = [int(t.shape[0]) for t in tensors if getattr(t, "dim", lambda: 0)() > 0]
    if not sizes:
        return 1
    return math.gcd(*sizes)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass
class _Search:
    """One run of the search: its captures, profiles and attempts."""

    model: torch.nn.Module
    tensors: tuple
    signature: CallSignature
    loss_fn: object
    method: AutoParallel
    cluster: Cluster | LogicalMesh
    meshes: list[LogicalMesh]
    inputs: str
    allow_pipeline: bool
    batch: int
    deadline: float
    variants: dict = field(default_factory=dict)
    """(micro-batches, remat, regather) -> the capture of that candidate (a caller's dict
    receives them: ``auto_parallel`` reuses the chosen one instead of tracing again)."""

    def __post_init__(self):
        self.started = time.perf_counter()
        from torchalpa.passes.pipeline_search.layer_cache import SolveCache
        from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
        self.nodes = getattr(self.cluster, "num_nodes", 1)   # a LogicalMesh: one node
        self.seconds: dict[str, float] = {}             # phase -> seconds spent in it
        self.clock_fired = False                       # the safety net stopped the search
        # what the candidates' solves repeat: layer and stage solves (pipelines), reshard
        # prices and strategies (both kinds), shared across micro-batch counts and remats
        self.solves = SolveCache()
        self.pricing = PricingMemo()
        # view -> values found read twice alike: each candidate's ILPs start from what
        # the candidates before found on that view (``plan_intra_op(sharing=)``)
        self.sharing: dict = {}
        self.profiles: dict = {}                       # remat -> its bounds (StepProfile)
        self.stage_bounds: dict[tuple, float] = {}     # pipeline -> ``stage_bound``
        # pipelines stopped after their layer ILPs -> the bound their layers' plans gave
        self.layer_bounds: dict[Candidate, float] = {}
        from torchalpa.frontends.rebatch import MicroBatchSteps
        from torchalpa.frontends.rebatch_check import RecordCheck
        from torchalpa.frontends.torch_export import record_step
        # micro-batch count -> its step: traced, or derived once a derivation was checked
        # (by records of the step's ops at two counts, else by a second trace)
        self.captures = MicroBatchSteps(
            lambda k: capture_step(self.model, capture_examples(self.model, self.tensors, k),
                                   self.loss_fn, signature=self.signature),
            RecordCheck(lambda k: record_step(
                self.model, capture_examples(self.model, self.tensors, k),
                cast(Any, self.loss_fn), signature=self.signature)))
        self._markers: int | None = None                # pipeline-boundary markers in forward
        self.attempts: list[Attempt] = []
        self.plans: list[tuple[float, Plan | PipelinePlan, Candidate]] = []
        # (intra-op candidate, view index, its plan's peak bytes; None: it does not fit)
        self.views: list[tuple[Candidate, int, float | None]] = []
        self.settled = 0                               # views settled that way
        self.floored = 0              # views refused by their memory floor (no ILP)
        self.gap: float | None = None                  # mip_rel_gap of the candidates' ILPs
        self.steps: dict[tuple[Candidate, int], float] = {}   # (candidate, view) -> its est
        # (candidate, view) -> the plan found within the gap: where its view is re-solved at
        # the solver's own gap, that solve starts from it (``plan_start.py``)
        self.found: dict[tuple[Candidate, int], Plan] = {}
        self.polished = 0                              # views re-solved at the solver's gap
        self.polish_note = ""
        self.layouts = [0, 0]          # data-parallel layouts weighed (weigh_layouts), won
        self.layouts_unweighed = False                 # the time budget spent before them
        self._layout_floor: float | None = None        # ``layout_floor``, once found
        self.offload_next = False      # host memory tried next where nothing fits (``run``)

    # -- captures ----------------------------------------------------------------------
    def capture(self, k: int, remat: str, regather: bool = False):
        """The step of one micro-batch of ``batch / k``, checkpointed by ``remat``, its
        parameters gathered again in backward if ``regather``: one trace, the other
        micro-batch counts and the variants derived from it."""
        if (k, remat, regather) not in self.variants:
            first = not self.variants
            with self.timed("capture"):
                self.variants[(k, remat, regather)] = derived_capture(self.captures(k), remat,
                                                                      regather)
            if first:      # a step that fails on its first call, said before any solve
                check_step_dtypes(self.variants[(k, remat, regather)].graph)
        return self.variants[(k, remat, regather)]

    @contextlib.contextmanager
    def timed(self, phase: str):
        """Add the seconds the block takes to ``phase`` (nested phases count once, in
        the innermost)."""
        start = time.perf_counter()
        outer = getattr(self, "_phase", None)
        self._phase = phase
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self._phase = outer
            self.seconds[phase] = self.seconds.get(phase, 0.0) + spent
            if outer is not None:
                self.seconds[outer] = self.seconds.get(outer, 0.0) - spent

    def regather_choices(self, kind: str) -> tuple[bool, ...]:
        """Whether parameters may be gathered again in backward: what the option fixes,
        else both for intra-op plans on several devices (pipelines keep forward's)."""
        fixed = self.method.rematerialize_parameters
        if self.method.auto_sharding_option.rematerialize_parameters or \
                self.method.offload == "parameters":     # backward copies its own
            fixed = True
        if fixed is not None:
            return (fixed,)
        return (False, True) if kind in ("intra-op", dp_layout.KIND) and \
            self.cluster.num_devices > 1 else (False,)

    # -- candidates --------------------------------------------------------------------
    def budget(self) -> float:
        """Bytes per device every plan must fit in (infinite where none is set); with
        parameters offloaded, less the streamed copies a device holds at once."""
        whole = self.method.auto_sharding_option.memory_budget_per_device or \
            self.cluster.memory_per_device or math.inf
        if self.method.offload != "parameters":
            return whole
        from torchalpa.passes.pricing.offload_price import device_window_bytes
        return whole - device_window_bytes(self.capture(self.first_count(), "none").graph)

    def profile(self, remat: str):
        """The bounds profile of the step checkpointed by ``remat`` (one per mode)."""
        from torchalpa.passes.pricing.bounds import step_profile
        if remat not in self.profiles:
            counts = self.counts()
            first = 1 if self.method.num_micro_batches is None else counts[0]
            with step(f"AutoParallel: bounds of remat={remat}") as progress:
                captured = self.capture(first, remat, self.regather_choices("intra-op")[0])
                with self.timed("bounds"):
                    self.profiles[remat] = step_profile(
                        captured.graph, self.meshes[0],
                        optimizer_states=self.method.optimizer_states,
                        eager=self.method.auto_sharding_option.elementwise != "fused",
                        optimizer=self.method.optimizer)
                progress.done = f"{len(captured.graph)} nodes"
        return self.profiles[remat]

    def counts(self) -> list[int]:
        return [self.method.num_micro_batches] if self.method.num_micro_batches else \
            _divisors(self.batch)

    def candidates(self) -> tuple[list[Candidate], list[Attempt]]:
        """Every candidate with its bounds, those that cannot fit apart. Only the lightest
        checkpointing mode's variant is derived and bounded here; the others take its
        time bound (sound: recomputing only adds work) until they are reached
        (``exact_candidate``), so variants no search reaches are never derived."""
        modes = [m for m in self.method.remat if m != "layers"]
        lightest = min(modes, key=_remat_weight, default=None)
        left(f"bounding the candidates of {len(self.method.remat)} checkpointing modes and "
             f"{len(self.counts())} micro-batch counts")
        found, refused = [], []
        for remat in modes:
            for c in self.bounded(remat, self.profile(lightest or remat)):
                if remat != lightest:
                    found.append(replace(c, exact=False))
                else:
                    (refused if c.memory_bound > self.budget() else found).append(c)
        if "layers" in self.method.remat:
            self.add_layer_modes(found, refused, self.counts())
        return sorted(found, key=self.order), [Attempt(c, "refused by bound") for c in refused]

    def order(self, c: Candidate) -> tuple:
        """The order candidates are tried in: by the time they are expected to take; of
        two alike but for regathering, the one likelier to win first (where memory is
        tight, gathering parameters again frees the room faster plans need)."""
        return (c.rank_s, c.regather != (c.memory_bound > 0.5 * self.budget()))

    def exact_candidate(self, c: Candidate) -> Candidate:
        """``c`` with the bounds of its own checkpointing mode's capture."""
        for e in self.bounded(c.remat, self.profile(c.remat)):
            if (e.kind, e.num_micro_batches, e.regather) == \
                    (c.kind, c.num_micro_batches, c.regather):
                return e
        raise AssertionError(f"no candidate {c.describe()} among its mode's")

    def bounded(self, remat: str, profile) -> list[Candidate]:
        """Every candidate of checkpointing mode ``remat``, bounded by ``profile``."""
        devices = self.cluster.num_devices
        out = []
        for k in self.counts():
            micro = self.batch // k
            out += self.kinds(remat, k, profile.step_seconds(devices, k, micro),
                              profile.memory_bytes(devices, micro),
                              profile.pipeline_memory_bytes(devices, micro),
                              self.pipeline_bounds(profile, k))
        return out

    def pipeline_bounds(self, profile, k: int) -> PipelineBounds:
        """The step time of a pipeline of ``k`` micro-batches by ``profile``: the bound (as
        many stages as the step has layers) and the order's (``_pipeline_stages``)."""
        devices, micro = self.cluster.num_devices, self.batch // k
        most = self.most_stages()
        assumed = min(_pipeline_stages(self.nodes, self.method), most)
        return PipelineBounds(
            profile.pipeline_step_seconds(devices, k, micro, max_stages=most),
            profile.pipeline_step_seconds(devices, k, micro, max_stages=assumed))

    def most_stages(self) -> int:
        """The most stages a pipeline candidate may cut the step into: one per layer
        (``passes/pipeline_search/layers.py::assign_layers``), at most one per device."""
        from torchalpa.passes.pipeline_search.layers import MARKER_OP
        devices = self.cluster.num_devices
        layers = self.method.layer_option.layer_num
        if layers == "auto":
            if self._markers is None:     # the same in every capture of the step
                self._markers = sum(1 for n in self.captures(self.first_count()).graph.ops()
                                    if n.op == MARKER_OP and n.phase == "forward")
            layers = self._markers + 1 if self._markers else min(2 * devices, 16)
        return max(1, min(int(layers), devices))

    def kinds(self, remat: str, k: int, bound: float, memory: float,
              pipeline_memory: float, pipeline: PipelineBounds) -> list[Candidate]:
        """The candidates of one checkpointing mode and micro-batch count ``k`` with these
        bounds: intra-op and pipeline, each with the regathering choices its kind has."""
        devices = self.cluster.num_devices
        stages = _pipeline_stages(self.nodes, self.method)
        multi_node = self.nodes > 1
        kinds = []
        # offload is priced for intra-op plans only: with it, no pipeline is weighed, and
        # the intra-op candidates are weighed on several nodes too
        pipelines = self.allow_pipeline and devices > 1 and self.method.pipeline is not False \
            and not self.method.offload
        if self.method.pipeline is not True and not (multi_node and pipelines):
            streamed = self.streamed_floor(k, bound)
            kinds.append(Candidate("intra-op", remat, k, streamed, memory, streamed))
        layout = dp_layout.view(self.meshes)
        if multi_node and pipelines and self.method.pipeline is not True and \
                self.layout_applies() and layout is not None and \
                dp_layout.divides(self.batch, k, layout):
            # the experts' data-parallel layout, which the pipelines' one-stage plan may miss
            floor = max(bound, self.layout_floor())
            kinds.append(Candidate(dp_layout.KIND, remat, k, floor, memory, floor))
        if pipelines:
            # sound: on several nodes one stage may span them all (S >= 1), on one
            # node the intra-op candidates are that case (S >= 2); the order
            # assumes ``stages`` stages, whose bubble many micro-batches shrink
            fill = 1.0 if multi_node else (k + 1) / k
            kinds.append(Candidate("pipeline", remat, k, pipeline.bound_s * fill,
                                   pipeline_memory,
                                   pipeline.assumed_s * (k + stages - 1) / k))
        return [replace(c, regather=regather) for c in kinds
                for regather in self.regather_choices(c.kind)]

    def streamed_floor(self, k: int, bound: float) -> float:
        """``bound`` of an intra-op candidate of ``k`` micro-batches, raised by what
        streaming parameters from the host pays at least where it does (the link up and
        the host's step, ``offload_price.streamed_floor_s``)."""
        if self.method.offload != "parameters":
            return bound
        from torchalpa.passes.pricing.offload_price import streamed_floor_s
        up, host = streamed_floor_s(self.capture(self.first_count(), "none").graph,
                                    OPTIMIZER_STATES[self.method.optimizer], self.cluster,
                                    self.cluster.num_devices, k)
        return max(bound, up) + host

    def first_count(self) -> int:
        """The micro-batch count whose capture the bounds are derived from."""
        return self.method.num_micro_batches or 1

    def add(self, found: list, refused: list, remat: str, k: int, bound: float,
            memory: float, pipeline_memory: float, pipeline: PipelineBounds) -> None:
        """The candidates of one checkpointing mode and micro-batch count ``k``, those that
        cannot fit apart."""
        for c in self.kinds(remat, k, bound, memory, pipeline_memory, pipeline):
            (refused if c.memory_bound > self.budget() else found).append(c)

    def add_layer_modes(self, found: list, refused: list, counts: list[int]) -> None:
        """Candidates checkpointing the first j of the step's L blocks ("full:j"), where
        memory is tight: the j ``passes/sharding/layer_remat.block_counts`` proposes, their bounds
        interpolated between keeping every block and checkpointing every one (the blocks
        are alike: each frees and costs its share)."""
        from torchalpa.passes.sharding.layer_remat import block_counts
        total = (self.capture(self.first_count(), "full", self.regather_choices("intra-op")[0]
                              ).graph.meta.get("remat") or {}).get("of", 0)
        none, full = self.profile("none"), self.profile("full")
        devices = self.cluster.num_devices
        for k in counts:
            micro = self.batch // k
            low, high = none.memory_bytes(devices, micro), full.memory_bytes(devices, micro)
            if low <= 0.5 * self.budget():
                continue          # memory is not tight: the uniform choices decide
            fast, slow = none.step_seconds(devices, k, micro), full.step_seconds(devices, k, micro)
            pipe_low = none.pipeline_memory_bytes(devices, micro)
            pipe_high = full.pipeline_memory_bytes(devices, micro)
            pipe_fast, pipe_slow = self.pipeline_bounds(none, k), self.pipeline_bounds(full, k)
            for j in block_counts(total, low, high, self.budget()):
                kept = (total - j) / total
                self.add(found, refused, f"full:{j}", k, fast + (1 - kept) * (slow - fast),
                         high + kept * (low - high), pipe_high + kept * (pipe_low - pipe_high),
                         PipelineBounds(
                             pipe_fast.bound_s + (1 - kept) * (pipe_slow.bound_s - pipe_fast.bound_s),
                             pipe_fast.assumed_s + (1 - kept) * (pipe_slow.assumed_s
                                                                 - pipe_fast.assumed_s)))

    def stage_bound(self, c: Candidate) -> float:
        """Pipeline candidate ``c``'s step time no plan of it beats, by its stages
        (``passes/pipeline_search/shape_bound.py``: the fill and drain of any cut of its
        layers, each stage's launches, floors and host time, its states on its devices),
        from ``c``'s own capture and the layers its search would cut; at least ``c.bound_s``.
        Kept per candidate and what else it depends on (the budget, the options)."""
        key = (c, self.budget(), self.method.optimizer_states, self.method.layer_option,
               self.method.auto_sharding_option.elementwise)
        if key not in self.stage_bounds:
            from torchalpa.passes.pipeline_search.layers import assign_layers
            from torchalpa.passes.pipeline_search.shape_bound import (
                layer_floors,
                pipeline_floor_s,
            )
            assert isinstance(self.cluster, Cluster), "pipelines are planned on a Cluster"
            graph = self.capture(c.num_micro_batches, c.remat, c.regather).graph
            with self.timed("bounds"):
                method = PipeshardParallel(num_micro_batches=c.num_micro_batches,
                                           layer_option=self.method.layer_option)
                layer = assign_layers(graph, method, self.cluster.num_devices)
                floors = layer_floors(
                    graph, layer, self.cluster, optimizer_states=self.method.optimizer_states,
                    eager=self.method.auto_sharding_option.elementwise != "fused")
                self.stage_bounds[key] = max(c.bound_s, pipeline_floor_s(
                    floors, self.cluster.num_devices, c.num_micro_batches, self.budget()))
        return self.stage_bounds[key]

    # -- solving -----------------------------------------------------------------------
    def sharding_option(self, c: Candidate):
        """The ``AutoShardingOption`` ``c``'s ILPs are solved under: the search's, with
        ``c``'s regathering, the offloading asked for and the gap ``gap_for`` gives (the
        checkpointing is in ``c``'s capture already)."""
        parameters = self.method.offload == "parameters"
        option = replace(self.method.auto_sharding_option, remat="none",
                         rematerialize_parameters=c.regather, offload=bool(self.method.offload),
                         offload_parameters=parameters,
                         # at least a byte: the copies in flight may take a whole device,
                         # and the option refuses a budget of no bytes
                         **({"memory_budget_per_device": max(self.budget(), 1.0)}
                            if parameters else {}))
        if self.gap_for(c) is not None:
            option = replace(option, gap=self.gap_for(c))
        return option

    def intra_op_method(self, c: Candidate) -> ShardParallel:
        """The ShardParallel intra-op candidate ``c`` is planned as on each view."""
        return ShardParallel(num_micro_batches=c.num_micro_batches,
                             auto_sharding_option=self.sharding_option(c),
                             optimizer=self.method.optimizer)

    def solve(self, c: Candidate, settled: dict[int, tuple[str, bool]] | None = None,
              starts: dict[int, Plan] | None = None, refuse_above: float | None = None):
        """The plan of candidate ``c`` (an InfeasibleError when it does not fit);
        ``settled``: its views not to solve (``settled_views``); ``starts``: view -> a plan
        of ``c`` there, its ILP's start (``plan_graph``'s); ``refuse_above``: a pipeline's
        search stops after its layer ILPs where they bound it at that or more
        (``layer_bound.CannotBeat``)."""
        option = self.sharding_option(c)
        captured = self.capture(c.num_micro_batches, c.remat, c.regather)
        if c.kind == dp_layout.KIND:
            plan = self.solve_layout(c, captured.graph)
        elif c.kind == "intra-op":
            from torchalpa.parallel.shard import blocks_of, plan_graph
            from torchalpa.passes.pipeline_search.stage_jobs import cpu_workers
            from torchalpa.passes.sharding.intra_op import least_memory_unsaid
            method = self.intra_op_method(c)
            outcomes: dict = {}
            settled = settled or {}
            seed = SearchSwitches.current().seed_sharing
            self.settled += len(settled)
            try:
                # a view that does not fit is an answer here, its least memory unsaid: the
                # notes keep the first line of a candidate's error
                with self.timed("intra-op ILPs"), least_memory_unsaid():
                    plan = plan_graph(captured.graph, method=method, meshes=self.meshes,
                                      inputs=self.inputs, blocks=blocks_of(captured.graph),
                                      deadline=self.deadline, bound_views=False,
                                      memo=self.pricing, workers=cpu_workers(),
                                      skip={i: why for i, (why, _) in settled.items()},
                                      outcomes=outcomes, starts=starts,
                                      sharing=self.sharing if seed else None)
            finally:
                self.record_views(c, outcomes)
        else:
            from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
            method = PipeshardParallel(num_micro_batches=c.num_micro_batches,
                                       auto_sharding_option=option,
                                       layer_option=self.method.layer_option,
                                       optimizer=self.method.optimizer)
            assert isinstance(self.cluster, Cluster), "pipelines are planned on a Cluster"
            with self.timed("pipeline searches (layer ILPs, stage DP)"):
                plan = plan_pipeline(captured.graph, self.cluster, method, inputs=self.inputs,
                                     solves=self.solves, pricing=self.pricing,
                                     refuse_above=refuse_above)
        from torchalpa.passes.sharding.remat_choice import remat_note
        plan = replace(plan, method={**plan.method, "remat": c.remat},
                       notes=tuple(plan.notes) + (remat_note(c.remat, captured.graph),))
        return with_offload(plan, captured.graph, self.cluster, self.method) \
            if self.method.offload else plan

    def run(self):
        """The best plan; with ``offload=None``, planned again with optimizer states in
        host memory when nothing fits on the devices, and with parameters and gradients
        there too when that does not fit either. A job whose model states alone fit none
        of these is refused first, before anything is traced (``states_floor``). The
        search is one progress step: its heartbeat says which phase or candidate it is
        in wherever no step inside it speaks (deriving captures, bounds, polishing)."""
        from torchalpa.parallel.states_floor import states_refusal
        # where nothing fits on the devices, host memory is tried next (``run_offloading``):
        # only the last try's error reaches the user, the others' first lines alone
        self.offload_next = self.method.weighs_offload
        refused = states_refusal(self.model, self.method, self.cluster)
        if refused:
            raise NothingFitsError(refused, [])
        with step(f"AutoParallel: searching {self.cluster.num_devices} devices "
                  f"({self.nodes} node(s))") as progress:
            plan = self.run_offloading()
            progress.done = self.plans_text()
        return plan

    def plans_text(self) -> str:
        """The search's result line: the best estimate and how many candidates planned."""
        planned = [a for a in self.attempts if a.outcome == "planned"]
        best = min((a.step_s for a in planned if a.step_s is not None), default=None)
        return (f"{len(planned)} candidates planned of {len(self.attempts)} weighed"
                + (f", best est {best:.4g} s/step" if best is not None else ""))

    def run_offloading(self):
        """``run`` past its floor: the devices first, then offloading where the method
        allows it (``run``'s docstring)."""
        try:
            return self.run_once()
        except NothingFitsError as e:
            if not self.method.weighs_offload:
                raise
            why = str(e).splitlines()[0].removesuffix("; tried:")
            self.check_host_memory(replace(self.method, offload=True), why)
            try:
                found = self.run_offloaded(True, why)
                what = "optimizer states"
            except NothingFitsError as again:       # parameters too, as a last resort
                found = self.run_offloaded("parameters", str(again).splitlines()[0]
                                           .removesuffix("; tried:"))
                what = "parameters, gradients and optimizer states"
            return replace(found, notes=tuple(found.notes) + (
                f"AutoParallel offloaded {what} to host memory: without it, " + why,))

    def run_offloaded(self, offload, why: str):
        """The best plan with ``AutoParallel(offload=offload)``; NothingFitsError saying
        ``why`` offloading was tried when the hosts or the devices cannot hold it."""
        self.check_host_memory(replace(self.method, offload=offload), why)
        self.method = replace(self.method, offload=offload)
        self.plans, self.profiles, self.views = [], {}, []   # bounds: what stays on devices
        self.deadline = time.perf_counter() + self.method.time_budget_s
        try:
            return self.run_once()
        except NothingFitsError as again:
            what = "parameters" if offload == "parameters" else "optimizer states"
            raise NothingFitsError(f"even with the {what} in host memory, " + str(again),
                                   again.attempts) from None

    def check_host_memory(self, method: AutoParallel, why: str = "") -> None:
        """A one-line NothingFitsError when the hosts cannot hold the offloaded states."""
        short = host_memory_shortfall(self.capture(self.first_count(), "none").graph,
                                      self.cluster, method, why)
        if short:
            raise NothingFitsError(short, self.attempts)

    def run_once(self):
        if self.method.offload:
            self.check_host_memory(self.method)
        candidates, self.attempts = self.candidates()
        single_node_fallback = self.nodes == 1 and self.method.pipeline is None
        first = [c for c in candidates if not (single_node_fallback and c.kind == "pipeline")]
        self.gap, self.steps, self.polished, self.polish_note = self.search_gap(), {}, 0, ""
        self.found, self.layer_bounds, self.layouts = {}, {}, [0, 0]
        self.layouts_unweighed = False
        try:
            self.solve_in_order(first)
            if not self.plans and len(first) < len(candidates):
                self.solve_in_order([c for c in candidates if c not in first])
            elif len(first) < len(candidates):
                self.attempts += [Attempt(c, "not needed", detail="an intra-op plan fits")
                                  for c in candidates if c not in first]
            gap, self.gap = self.gap, None
            if gap is not None:
                self.polish(gap)
            self.weigh_layouts()
        finally:
            self.gap = None
        return self.result()

    def search_gap(self) -> float | None:
        """The relative gap tight candidates' intra-op ILPs stop at (``gap_for``): the
        search's tolerance (it already returns a plan that a candidate it did not solve
        may beat by that much), where the option leaves the solver's gap unset and the
        tolerance is wider than HiGHS' default (1e-4); None: the solver's own gap."""
        tolerance = self.method.tolerance
        if not SearchSwitches.current().search_gap or tolerance <= 1e-4 or \
                self.method.auto_sharding_option.gap is not None:
            return None
        return tolerance

    def gap_for(self, c: Candidate) -> float | None:
        """The gap ``c``'s ILPs stop at (None: the solver's own): the search's, for an
        intra-op candidate whose memory is tight (its bound above half the budget, as
        ``order`` has it). Elsewhere the ILPs are nearly integral and quick, and solving
        the winner twice would cost more than the gap saves."""
        if self.gap is None or c.kind != "intra-op" or c.memory_bound <= 0.5 * self.budget():
            return None
        return self.gap

    def polish(self, gap: float) -> None:
        """Re-solve at the solver's own gap each intra-op view whose plan, found within
        ``gap``, could hide one better than the best plan re-solved so far (its estimate
        times ``1 - gap`` below it), the likeliest first; a candidate keeps the better of
        its two plans. The chosen plan is then the one the solver's own gap gives on its
        view (the same as solving every view so, where that view wins there too), and the
        views left unpolished lose by more than the gap: near the memory budget those are
        the ILPs HiGHS spends minutes on (``benchmarks/near_budget_ab.py``). Each re-solve
        starts from the plan its view found within ``gap`` (``plan_start.py``): a feasible
        point of the same problem, which spares HiGHS finding one and keeps its guarantee."""
        from torchalpa.passes.sharding.ilp import InfeasibleError
        views = sorted(((step_s, c, i) for (c, i), step_s in self.steps.items()),
                       key=lambda v: v[0])
        # the best estimate of a plan at the solver's gap (pipelines are solved so)
        exact = min((p[0] for p in self.plans if p[2].kind != "intra-op"), default=math.inf)
        for n, (step_s, c, i) in enumerate(views):
            if step_s * (1 - gap) >= exact:
                break
            left(f"re-solving view {n + 1}/{len(views)} at the solver's own gap")
            at = next((n for n, p in enumerate(self.plans) if p[2] is c), None)
            if at is None:          # rejected over the budget: not among the plans
                continue
            skip = {j: (f"solved to within {gap:.0%} (the search's tolerance): "
                        f"{self.steps[(c, j)] * 1e3:.3g} ms" if (c, j) in self.steps
                        else "not re-solved", True) for j in range(len(self.meshes)) if j != i}
            start = {i: self.found[(c, i)]} if (c, i) in self.found else None
            try:
                plan = self.solve(c, skip, start)
            except InfeasibleError:       # cannot happen (the gap changes no feasibility)
                continue
            finally:
                self.settled -= len(skip)
            self.polished += 1
            found = known(plan.estimates.step_time_s)
            exact = min(exact, found)
            if found < self.plans[at][0] and not self.over_budget(plan):
                self.plans[at] = (found, plan, c)
        self.polish_note = (f"AutoParallel solved the intra-op ILPs to within {gap:.0%} (its "
                            f"tolerance) and re-solved at the solver's own gap the "
                            f"{self.polished} of {len(views)} views that could win")

    def layout_applies(self) -> bool:
        """Whether the search weighs the data-parallel layout (``dp_layout.applies``)."""
        return dp_layout.applies(self.method.auto_sharding_option, dp_layout.view(self.meshes))

    def layout_floor(self) -> float:
        """The data-parallel layout's gradient reductions (``dp_layout.gradient_floor_s``),
        from the plain capture (every variant trains the same parameters); kept."""
        if self._layout_floor is None:
            mesh = dp_layout.view(self.meshes)
            assert mesh is not None, "layout_floor needs a one-axis view (layout_applies)"
            self._layout_floor = dp_layout.gradient_floor_s(
                self.capture(self.first_count(), "none").graph, mesh)
        return self._layout_floor

    def solve_layout(self, c: Candidate, graph):
        """Candidate ``c``'s plan in the data-parallel layout (``dp_layout``): the ILP
        restricted to it on the one-axis view over every device. An InfeasibleError where
        it does not fit, or where a micro-batch does not split over the devices."""
        from torchalpa.parallel.shard import blocks_of, plan_graph
        from torchalpa.passes.sharding.ilp import InfeasibleError
        from torchalpa.passes.sharding.intra_op import least_memory_unsaid
        mesh = dp_layout.view(self.meshes)
        assert mesh is not None, "solve_layout needs a one-axis view (layout_applies)"
        if not dp_layout.divides(self.batch, c.num_micro_batches, mesh):
            raise InfeasibleError(f"a micro-batch of {self.batch // c.num_micro_batches} does "
                                  f"not split over {mesh.num_devices} devices")
        method = self.intra_op_method(c)
        method = replace(method, auto_sharding_option=dp_layout.option(
            method.auto_sharding_option))
        outcomes: dict = {}
        try:
            # a layout that does not fit is an answer: its least memory is not needed
            with self.timed("data-parallel layouts"), least_memory_unsaid():
                return plan_graph(graph, method=method, meshes=[mesh], inputs=self.inputs,
                                  blocks=blocks_of(graph), deadline=self.deadline,
                                  bound_views=False, memo=self.pricing, outcomes=outcomes)
        finally:
            self.floored += _floored_views(outcomes)

    def weigh_layouts(self) -> None:
        """Each intra-op candidate planned whose own bound lets a plan of it beat the best
        plan in hand by more than the tolerance (the layout is one of its plans: the bound
        holds for it too), best first, also planned in the data-parallel layout; it keeps
        whichever plan the estimate prices lower (``dp_layout.better``). A layout that
        wins lowers the best, and with it the candidates left to weigh. The free plan's
        estimate does not say how far below it the layout's is (5.5 % on MPT-13B on 8 A100
        40GB), so it does not decide which candidates are weighed."""
        from torchalpa.passes.sharding.ilp import InfeasibleError
        mesh = dp_layout.view(self.meshes)
        if mesh is None or not self.layout_applies():
            return
        if self.plans and time.perf_counter() > self.deadline:
            self.layouts_unweighed = True      # the safety net: no more solves once it fired
            return
        for at in sorted(range(len(self.plans)), key=lambda n: self.plans[n][0]):
            _, plan, c = self.plans[at]
            best = min(p[0] for p in self.plans)
            if c.bound_s * (1 + self.method.tolerance) >= best:
                continue
            if c.kind != "intra-op" or not isinstance(plan, Plan) or \
                    not dp_layout.divides(self.batch, c.num_micro_batches, mesh):
                continue
            left(f"weighing the data-parallel layout of {c.describe()}")
            self.layouts[0] += 1
            try:
                layout = self.solve(replace(c, kind=dp_layout.KIND))
            except InfeasibleError:
                continue
            assert isinstance(layout, Plan), "a data-parallel layout is an intra-op plan"
            kept = dp_layout.better(plan, layout, mesh, c.regather)
            if kept is not plan and not self.over_budget(kept):
                self.plans[at] = (known(kept.estimates.step_time_s), kept, c)
                self.layouts[1] += 1

    def solve_in_order(self, candidates: list[Candidate]) -> None:
        """Solve ``candidates`` in order until none left can win (bounds, dominance) or the
        time budget is spent once a plan is in hand. A candidate bounded by another
        mode's capture gets its own bounds when reached, and goes back in line by them
        (or is refused by them): the order is the one exact bounds give."""
        from torchalpa.passes.pipeline_search.layer_bound import CannotBeat
        from torchalpa.passes.sharding.ilp import InfeasibleError
        candidates = list(candidates)
        i = -1
        while i + 1 < len(candidates):
            i += 1
            c = candidates[i]
            left(f"candidate {i + 1}/{len(candidates)}, {c.describe()}")
            best = min(self.plans, key=lambda p: p[0], default=None)
            if best is not None and c.bound_s * (1 + self.method.tolerance) >= best[0]:
                self.attempts.append(Attempt(c, "not needed"))
                continue
            if best is not None and time.perf_counter() > self.deadline:
                self.attempts += [Attempt(r, "no time") for r in candidates[i:]]
                self.clock_fired = True
                break
            refused = self.refusal(c)
            if refused is not None:
                self.attempts.append(refused)
                continue
            lighter = self.stopped_lighter(c)
            if best is not None and lighter is not None and \
                    self.layer_bounds[lighter] * (1 + self.method.tolerance) >= best[0]:
                self.attempts.append(Attempt(c, "not needed", detail=(
                    f"{LAYER_BOUND}{self.layer_bounds[lighter]:.4g} s/step, those of "
                    f"{lighter.describe()}, which recomputes less (a bound)")))
                continue
            if not c.exact:
                self.requeue_exact(candidates, i)
                continue
            settled = self.settled_views(c)
            if len(settled) == len(self.meshes):
                self.settled += len(settled)
                self.attempts.append(Attempt(c, "not needed",
                                             detail=_settled_text(settled, self.meshes)))
                continue
            beaten = None if best is None else self.cannot_beat(c, best[0], settled)
            if beaten is not None:
                self.attempts.append(beaten)
                continue
            start = time.perf_counter()
            more = len(candidates) - i - 1
            with step(f"AutoParallel: candidate {i + 1}/{len(candidates)}, {c.describe()} "
                      f"(bound {c.bound_s:.4g} s/step; {more} more at most) solving"
                      ) as progress:
                try:
                    plan = self.solve(c, settled, refuse_above=None if best is None else
                                      best[0] / (1 + self.method.tolerance))
                except CannotBeat as e:
                    self.layer_bounds[c] = e.bound_s
                    self.attempts.append(Attempt(
                        c, "not needed", seconds=time.perf_counter() - start,
                        detail=f"{LAYER_BOUND}{e.bound_s:.4g} s/step, stopped after its "
                               "layer ILPs (a bound)"))
                    progress.done = f"cannot beat {best[0]:.4g} s/step" if best else ""
                    continue
                except InfeasibleError as e:
                    # where a view was settled by dominance, c may fit there: not "does not fit"
                    dominated = any(by for _, by in settled.values())
                    self.attempts.append(Attempt(
                        c, "not needed" if dominated else "does not fit",
                        seconds=time.perf_counter() - start, detail=_settled_text(settled, self.meshes)
                        if dominated else str(e).splitlines()[0]))
                    progress.done = "does not fit"
                    continue
                progress.done = self.record(c, plan, time.perf_counter() - start)

    def cannot_beat(self, c: Candidate, best_s: float,
                    settled: dict[int, tuple[str, bool]]) -> Attempt | None:
        """``c`` refused before its solves where a bound finer than ``c.bound_s`` says it
        cannot beat the best plan in hand (``best_s``) by more than the tolerance: a
        pipeline's by its stages (``stage_bound``), a checkpointing intra-op candidate's by
        the linear relaxations of its views not ``settled`` (``relaxed_bound.py``)."""
        if c.kind == "pipeline" and self.stage_bound(c) * (1 + self.method.tolerance) >= best_s:
            return Attempt(c, "not needed", detail=(
                f"{STAGE_BOUND}{self.stage_bound(c):.4g} s/step (its stages' fill and "
                "drain, launches and host time; a bound)"))
        beat = best_s / (1 + self.method.tolerance)
        relaxed = self.relaxed_bound(c, settled, beat)
        if relaxed is not None and relaxed >= beat:
            return Attempt(c, "not needed", detail=(
                f"{RELAXED_BOUND}{relaxed:.4g} s/step (a bound)"))
        return None

    def relaxed_bound(self, c: Candidate, settled: dict[int, tuple[str, bool]],
                      beat: float) -> float | None:
        """The least LP bound of checkpointing intra-op candidate ``c``'s views not
        ``settled`` (``relaxed_bound.views_bound``, stopping at one under ``beat``); None
        for other candidates, with offloading (priced after the solve) or where the
        switch is off."""
        if c.kind != "intra-op" or c.remat == "none" or self.method.offload or \
                not SearchSwitches.current().relaxed_bounds:
            return None
        from torchalpa.parallel.relaxed_bound import views_bound
        from torchalpa.parallel.shard import blocks_of
        graph = self.capture(c.num_micro_batches, c.remat, c.regather).graph
        with self.timed("bounds"):
            return views_bound(graph, self.meshes, self.intra_op_method(c),
                               inputs=self.inputs, memo=self.pricing,
                               blocks=blocks_of(graph), skip=settled, below=beat)

    def record(self, c: Candidate, plan: Plan | PipelinePlan, seconds: float) -> str:
        """Keep ``c``'s ``plan`` (solved in ``seconds``) among the plans in hand, or refuse it
        where its estimate is over the budget; what the progress line ends with."""
        est = plan.estimates
        over = self.over_budget(plan)
        if over:        # the solver's memory model and the estimate's disagree:
            # its views' peaks settle no other candidate's views either
            self.views = [v for v in self.views if v[0] is not c]
            self.attempts.append(Attempt(c, "over the budget", seconds=seconds, detail=over))
            return "over the budget"
        step_s = known(est.step_time_s)
        self.attempts.append(Attempt(c, "planned", step_s, est.memory_per_device_bytes,
                                     seconds))
        self.plans.append((step_s, plan, c))
        return f"est {step_s:.4g} s/step"

    def stopped_lighter(self, c: Candidate) -> Candidate | None:
        """A pipeline candidate alike but for recomputing at most what ``c`` does whose
        search its layers' own plans stopped (``layer_bounds``), the highest bound first:
        recomputing only adds work to every layer's plan (as the candidates' time bounds
        have it), so that bound is ``c``'s too, and ``c`` needs no layer ILP of its own."""
        from torchalpa.passes.sharding.layer_remat import more_recompute
        if c.kind != "pipeline":
            return None
        alike = [p for p in self.layer_bounds
                 if (p.num_micro_batches, p.regather) == (c.num_micro_batches, c.regather)
                 and more_recompute(p.remat, c.remat)]
        return max(alike, key=lambda p: self.layer_bounds[p], default=None)

    def refusal(self, c: Candidate) -> Attempt | None:
        """Why ``c`` need not be solved, from what the candidates before it found: a
        candidate that recomputes more did not fit, or one solved dominates it."""
        tighter = self.does_not_fit_either(c)
        if tighter is not None:
            return Attempt(c, "not needed", detail=(
                f"{tighter.describe()} does not fit, and this recomputes less"))
        by = self.dominating(c)
        if by is not None:
            return Attempt(c, "dominated", detail=by.describe())
        return None

    def requeue_exact(self, candidates: list[Candidate], i: int) -> None:
        """Candidate ``i``, bounded by another mode's capture, with its own bounds: refused
        by them, or put back in line after ``i`` by them (``order``)."""
        c = self.exact_candidate(candidates[i])
        if c.memory_bound > self.budget():
            self.attempts.append(Attempt(c, "refused by bound"))
            return
        rest = candidates[i + 1:]
        at = next((j for j, r in enumerate(rest) if self.order(r) > self.order(c)), len(rest))
        candidates[i + 1:] = rest[:at] + [c] + rest[at:]

    def over_budget(self, plan) -> str:
        """Why ``plan`` cannot be returned: its estimated peak is above the memory budget
        (what the user set or the cluster has, the streamed copies of offloaded parameters
        included in both); "" where it fits. The solvers fit their own memory models to
        the budget; this is the one check every plan, intra-op or pipeline, passes."""
        whole = self.method.auto_sharding_option.memory_budget_per_device or \
            self.cluster.memory_per_device
        peak = plan.estimates.memory_per_device_bytes
        if not whole or peak is None or peak <= whole * (1 + 1e-9):
            return ""
        return (f"its plan was estimated at {format_bytes(peak)} per device, above the "
                f"{format_bytes(whole)} budget (the solver's memory model found it fit); "
                "rejected")

    def record_views(self, c: Candidate, outcomes: dict) -> None:
        """What each view solved for ``c`` gave (``plan_graph``'s outcomes): its plan's
        peak, or None where it proved not to fit (not where a time limit stopped it)."""
        from torchalpa.passes.sharding.ilp import SolverStopped
        self.floored += _floored_views(outcomes)
        for i, found in sorted(outcomes.items()):
            if isinstance(found, Plan):
                self.views.append((c, i, found.estimates.memory_per_device_bytes))
                if self.gap_for(c) is not None:
                    self.steps[(c, i)] = known(found.estimates.step_time_s)
                    self.found[(c, i)] = found
            elif not isinstance(found, SolverStopped):
                self.views.append((c, i, None))

    def settled_views(self, c: Candidate) -> dict[int, tuple[str, bool]]:
        """Views of intra-op candidate ``c`` that other candidates' answers settle, view
        index -> (why, whether by dominance), by the rules the search applies to whole
        candidates (``does_not_fit_either``, ``dominating``) applied to one view: it does
        not fit where a candidate alike but recomputing at least what ``c`` does did not,
        and ``c`` only adds work where a candidate of no more micro-batches, regathering
        and recomputing fits with room to spare (that plan is among the search's)."""
        from torchalpa.passes.sharding.layer_remat import more_recompute
        if not SearchSwitches.current().reuse_views or c.kind != "intra-op" or \
                self.method.offload:
            return {}
        budget, settled = self.budget(), {}
        for p, i, peak in self.views:
            if i in settled:
                continue
            if peak is None and (p.num_micro_batches, p.regather) == \
                    (c.num_micro_batches, c.regather) and more_recompute(c.remat, p.remat):
                settled[i] = (f"does not fit ({p.describe()} did not, and this recomputes "
                              "less)", False)
            elif peak is not None and peak < ROOM * budget and more_recompute(p.remat, c.remat) \
                    and p.num_micro_batches <= c.num_micro_batches and p.regather <= c.regather:
                settled[i] = (f"only adds work to {p.describe()}, which fits here with room "
                              "to spare", True)
        return settled

    def does_not_fit_either(self, c: Candidate) -> Candidate | None:
        """A candidate alike but for recomputing at least what ``c`` does (more blocks
        checkpointed) that was solved and did not fit: ``c`` keeps more, so it cannot fit
        either (what makes per-layer candidates cheap to rule out)."""
        from torchalpa.passes.sharding.layer_remat import more_recompute
        for a in self.attempts:
            p = a.candidate
            if a.outcome == "does not fit" and p.kind == c.kind and \
                    p.num_micro_batches == c.num_micro_batches and p.regather == c.regather \
                    and more_recompute(c.remat, p.remat):
                return p
        return None

    def dominating(self, c: Candidate) -> Candidate | None:
        """A planned candidate of ``c``'s kind that fits with room to spare and whose plan
        ``c`` could only make slower (more recompute; for intra-op, more micro-batches)."""
        from torchalpa.passes.sharding.layer_remat import more_recompute
        budget = self.budget()
        for _, plan, p in self.plans:
            peak = plan.estimates.memory_per_device_bytes
            roomy = peak is not None and peak < ROOM * budget
            fewer = p.num_micro_batches <= c.num_micro_batches \
                if c.kind in ("intra-op", dp_layout.KIND) \
                else p.num_micro_batches == c.num_micro_batches
            if roomy and p.kind == c.kind and fewer and p.regather <= c.regather and \
                    more_recompute(p.remat, c.remat):
                return p
        return None

    def result(self):
        if not self.plans:
            last = not self.offload_next or self.method.offload == "parameters"
            raise NothingFitsError(self.nothing_fits(advise=last), self.attempts)
        ranked = sorted(self.plans, key=lambda p: p[0])
        step_s, plan, chosen = ranked[0]
        notes = [f"{CHOSEN}{chosen.describe()}: est {step_s:.4g} s/step"]
        if len(ranked) > 1:
            notes.append(f"{RUNNER_UP}{ranked[1][2].describe()}: est {ranked[1][0]:.4g} s/step")
        notes += [TRIED + a.line() for a in self.attempts if a.candidate is not chosen]
        if self.polish_note:
            notes.append(self.polish_note)
        if self.layouts[0]:
            notes.append(f"AutoParallel weighed the data-parallel layout of the "
                         f"{self.layouts[0]} intra-op candidate(s) planned whose bounds let "
                         f"it beat the best; it won on {self.layouts[1]}")
        notes.append(self.time_note())
        if self.layouts_unweighed:
            from torchalpa.passes.sharding.ilp import CLOCK_NOTE
            notes.append(f"{CLOCK_NOTE} AutoParallel's search (time_budget_s="
                         f"{self.method.time_budget_s:g}): the data-parallel layout was not "
                         "weighed")
        if self.clock_fired:
            from torchalpa.passes.sharding.ilp import CLOCK_NOTE
            notes.append(f"{CLOCK_NOTE} AutoParallel's search (time_budget_s="
                         f"{self.method.time_budget_s:g}): candidates were left unsolved; a "
                         "faster or idler machine may find a better plan")
        return replace(plan, notes=tuple(plan.notes) + tuple(notes))

    def time_note(self) -> str:
        """How the search's time split: capture, bounds, solves (each phase's seconds)."""
        total = time.perf_counter() - self.started
        parts = [f"{phase} {seconds:.1f} s" for phase, seconds in self.seconds.items()]
        rest = total - sum(self.seconds.values())
        settled = sum(1 for a in self.attempts if a.detail.startswith(SETTLED))
        staged = sum(1 for a in self.attempts if a.detail.startswith(STAGE_BOUND))
        layered = sum(1 for a in self.attempts if a.detail.startswith(LAYER_BOUND))
        from torchalpa.passes.pipeline_search.stage_jobs import cpu_workers
        steps = self.captures
        return (f"AutoParallel planned in {total:.1f} s: " + ", ".join(parts)
                + f", the rest {max(rest, 0.0):.1f} s"
                + f"; the step at micro-batch counts {_listed(steps.captures)}: "
                  f"{steps.how_made()}"
                + (f"; intra-op views solved in up to {cpu_workers()} processes"
                   if "intra-op ILPs" in self.seconds and cpu_workers() > 1 else "")
                + (f"; {self.settled} views settled by other candidates' answers (no ILP)"
                   if self.settled else "")
                + (f"; {settled} candidates settled without an ILP" if settled else "")
                + (f"; {self.floored} views refused by their memory floor (no ILP)"
                   if self.floored else "")
                + (f"; {staged} pipeline candidates refused by their stages' bound, "
                   "before their layer ILPs" if staged else "")
                + (f"; {layered} pipeline candidates refused by their layers' own plans, "
                   "before their stage ILPs" if layered else ""))

    def nothing_fits(self, advise: bool = True) -> str:
        """What was tried, and, with ``advise``, what would fit (by the views' memory
        floors)."""
        devices, budget = self.cluster.num_devices, self.budget()
        whole = self.method.auto_sharding_option.memory_budget_per_device or \
            self.cluster.memory_per_device
        room = f"{format_bytes(budget)} per device" if not whole or budget == whole else \
            (f"{format_bytes(whole)} per device ({format_bytes(whole - budget)} of it kept "
             "for the offloaded parameters' copies in flight)")
        lines = [f"no way to run this step fits {room} on "
                 f"{devices} devices ({self.nodes} node(s)); tried:"]
        lines += ["  " + a.line() for a in self.attempts]
        if not advise:
            return "\n".join(lines)
        if budget <= 0:     # the offloaded copies in flight alone exceed each device
            lines.append("what would fit: devices with more memory than the copies in flight "
                         "to and from host memory take, or a smaller model or sequence")
            return "\n".join(lines)
        lines.append(self.would_fit(budget, whole - budget if whole else 0.0))
        return "\n".join(lines)

    def would_fit(self, budget: float, kept: float) -> str:
        """What would fit by the views' memory floors (``fit_advice``), for intra-op plans
        of the checkpointing that recomputes most, the most micro-batches and, where the
        search may, parameters gathered again in backward: of the ways it weighs, the one
        that keeps least in memory; ``kept``: bytes of each device kept for the offloaded
        parameters' copies."""
        from torchalpa.parallel.fit_advice import fit_advice
        leanest = max((m for m in self.method.remat if m != "layers"), default="full",
                      key=_remat_weight)
        k, regather = max(self.counts()), max(self.regather_choices("intra-op"))
        micro = self.batch // k
        with self.timed("what would fit (memory floors)"):
            needed = self.profile(leanest).devices_to_fit(budget, micro)
            candidate = Candidate("intra-op", leanest, k, 0.0, 0.0, regather=regather)
            advice = fit_advice(self.capture(k, leanest, regather).graph, self.meshes,
                                self.intra_op_method(candidate), inputs=self.inputs,
                                bound_devices=needed, kept=kept)
        how = (f"intra-op plans with remat={leanest}, micro-batches of {micro}"
               + (", parameters gathered again in backward" if regather else ""))
        if advice is None:     # no budget the floors know of: the step's bound alone
            return (f"what would fit: at least {needed} devices of {format_bytes(budget)} "
                    f"({how}; the step's memory bound), or a smaller model or sequence")
        return (f"what would fit: {how} on {advice.devices_text()}; or on "
                f"{advice.memory_text()}; or a smaller model or sequence")


def _floored_views(outcomes: dict) -> int:
    """How many of ``plan_graph``'s ``outcomes`` its views' memory floors refused
    (``view_floor.FloorRefusal``: no ILP built)."""
    from torchalpa.passes.sharding.view_floor import FloorRefusal
    return sum(isinstance(found, FloorRefusal) for found in outcomes.values())


def _settled_text(settled: dict[int, tuple[str, bool]], meshes: list[LogicalMesh]) -> str:
    """Why the views ``settled`` were not solved, and that the others did not fit."""
    return SETTLED + "; ".join(
        f"{'x'.join(map(str, meshes[i].shape))}: {why}" for i, (why, _) in
        sorted(settled.items())) + ("" if len(settled) == len(meshes) else
                                    "; the other views do not fit")


def derived_capture(plain: Capture, remat: str, regather: bool) -> Capture:
    """The candidate's capture, derived from the plain one without tracing again:
    checkpointed by ``remat``, parameters gathered again in backward if ``regather``. Every
    rank derives the chosen one this way, so rank 0 reuses the search's capture and the
    others' steps still match it."""
    if remat == "none" and not regather:
        return plain
    from torchalpa.frontends.block_remat import checkpointed_capture
    return checkpointed_capture(plain, remat, rematerialize_parameters=regather)


def _remat_weight(mode: str) -> tuple[int, float]:
    """How much a checkpointing mode recomputes, to find the lightest: none < selective <
    the first k blocks in full (by k) < every block in full."""
    policy, count = parse_remat(mode)
    return {"none": 0, "selective": 1, "full": 2}[policy], math.inf if count is None else count


def _pipeline_stages(nodes: int, method: AutoParallel) -> int:
    """How many stages a pipeline candidate could cut the step into, for its micro-batch
    count: one per node on several nodes, else two (at most the layers it clusters)."""
    layers = method.layer_option.layer_num
    most = layers if isinstance(layers, int) else 16
    return max(2, min(nodes if nodes > 1 else 2, most))


def search_method(model, example_inputs, loss_fn, *, method: AutoParallel,
                  cluster: Cluster | LogicalMesh,
                  meshes: list[LogicalMesh], inputs: str = "global",
                  allow_pipeline: bool = True, signature: CallSignature | None = None,
                  captures: dict | None = None):
    """The plan of the fastest candidate that fits (a Plan or a PipelinePlan), with notes
    on what was chosen and what came second; ``NothingFitsError`` when none fits.
    ``example_inputs``: the whole batch (a tuple of tensors, with ``signature`` saying how
    the model is called); ``meshes``: the logical views intra-op candidates try;
    ``captures``: a dict that receives the search's captures (``derived_capture``'s)."""
    return SearchSession(model, example_inputs, loss_fn, method=method, cluster=cluster,
                         meshes=meshes, inputs=inputs, allow_pipeline=allow_pipeline,
                         signature=signature, captures=captures).run()


class SearchSession:
    """``search_method`` kept open: its captures, bounds and solve caches are reused by
    every ``run`` and ``solve``, so one model is planned under several options (memory
    budgets, say) without being traced again (``benchmarks/layer_remat.py``). Arguments as
    ``search_method``'s."""

    def __init__(self, model, example_inputs, loss_fn, *, method: AutoParallel,
                 cluster: Cluster | LogicalMesh, meshes: list[LogicalMesh],
                 inputs: str = "global", allow_pipeline: bool = True,
                 signature: CallSignature | None = None, captures: dict | None = None):
        if signature is None:
            signature, tensors = CallSignature.of(example_inputs)
        else:
            tensors = tuple(example_inputs)
        batch = batch_size(tensors)
        if method.num_micro_batches is not None and batch % method.num_micro_batches:
            raise ValueError(f"AutoParallel(num_micro_batches={method.num_micro_batches}) does "
                             f"not divide the batch of {batch}; use a divisor of it")
        self.method = method
        self._search = _Search(model, tensors, signature, loss_fn, method, cluster, meshes,
                               inputs, allow_pipeline, batch,
                               time.perf_counter() + method.time_budget_s,
                               {} if captures is None else captures)

    def run(self, method: AutoParallel | None = None):
        """The plan of the fastest candidate that fits ``method`` (the session's if None;
        it must keep the session's ``num_micro_batches``), searched afresh within its
        ``time_budget_s``; ``NothingFitsError`` when none fits."""
        search = self._search
        search.method = self._checked(method)
        search.plans, search.attempts, search.views = [], [], []
        search.deadline = time.perf_counter() + search.method.time_budget_s
        return search.run()

    def solve(self, candidate: Candidate, method: AutoParallel | None = None):
        """The plan of one candidate (``Candidate(kind, remat, num_micro_batches, 0, 0)``)
        under ``method`` (the session's if None); ``InfeasibleError`` when it does not fit."""
        search = self._search
        search.method = self._checked(method)
        search.deadline = time.perf_counter() + search.method.time_budget_s
        return search.solve(candidate)

    def _checked(self, method: AutoParallel | None) -> AutoParallel:
        if method is None:
            return self.method
        if method.num_micro_batches != self.method.num_micro_batches:
            raise ValueError(f"a SearchSession made for num_micro_batches="
                             f"{self.method.num_micro_batches} cannot plan for "
                             f"{method.num_micro_batches}; open another session")
        return method


@dataclass(frozen=True)
class AutoTarget:
    """What the search plans for: the cluster, the views intra-op candidates try, the
    DeviceMesh the user gave (None: built from the plan) and whether pipelines may run."""

    cluster: Cluster | LogicalMesh
    meshes: list[LogicalMesh]
    device_mesh: object = None
    allow_pipeline: bool = True


class AutoResolver:
    """``MethodResolver`` of ``AutoParallel`` (``torchalpa.parallel.steps``): it chooses a
    concrete method by searching (``search``), and the orchestration goes on with that
    method's own steps."""

    def with_options(self, method: AutoParallel, *, inputs: str = "global", signature=None,
                     mesh=None, num_micro_batches: int | None = None,
                     init_weights=None) -> AutoParallel:
        """auto_parallel's options narrow the search: a given mesh, inputs='local',
        keyword inputs or init_weights= rule pipelines out (they need the global batch on
        every rank and real weights); ``num_micro_batches`` fixes the count."""
        reasons = [why for given, why in (
            (mesh is not None, "mesh= fixes one mesh for the whole step"),
            (inputs != "global", "inputs='local' gives each rank only its shard"),
            (signature is not None and signature.by_keyword, "the model is called by keyword"),
            (init_weights is not None, "init_weights= initializes a meta model in place"))
            if given]
        if reasons and method.pipeline is True:
            raise ValueError(f"AutoParallel(pipeline=True) cannot run here: {reasons[0]}, which "
                             "a pipeline cannot honour; leave pipeline= unset or drop the option")
        if reasons:
            method = replace(method, pipeline=False)
        if num_micro_batches is not None:
            if method.num_micro_batches not in (None, num_micro_batches):
                raise ValueError(f"num_micro_batches={num_micro_batches} disagrees with "
                                 f"AutoParallel(num_micro_batches={method.num_micro_batches}); "
                                 "give it in one place")
            method = replace(method, num_micro_batches=num_micro_batches)
        return method

    def target(self, method: AutoParallel, *, cluster, mesh, world: int,
               live: bool) -> AutoTarget:
        from torchalpa.parallel.shard import IntraOpSteps
        intra = IntraOpSteps().target(ShardParallel(), cluster=cluster, mesh=mesh, world=world,
                                      live=live)
        pipelines = isinstance(intra.cluster, Cluster) and method.pipeline is not False
        if method.pipeline is True and not (pipelines and intra.cluster.num_devices > 1):
            raise ValueError("AutoParallel(pipeline=True) needs a pipeline of 2 or more "
                             "stages: " + ("a Cluster (a LogicalMesh has no nodes to cut "
                                           "into submeshes)" if not pipelines else
                                           "2 or more devices, the cluster has 1")
                             + "; leave pipeline= unset to plan without stages")
        return AutoTarget(intra.cluster, intra.meshes, intra.device_mesh,
                          allow_pipeline=pipelines)

    def search(self, model, example_inputs, loss_fn, *, method: AutoParallel,
               target: AutoTarget, inputs: str, signature=None, captures=None):
        return search_method(model, example_inputs, loss_fn, method=method,
                             cluster=target.cluster, meshes=target.meshes, inputs=inputs,
                             allow_pipeline=target.allow_pipeline, signature=signature,
                             captures=captures)

    def check_plan_kind(self, plan) -> None:
        if not isinstance(plan, (Plan, PipelinePlan)):
            raise TypeError(f"plan must be a torchalpa.Plan or PipelinePlan, got "
                            f"{type(plan).__name__}")

    def concrete(self, method: AutoParallel) -> ShardParallel:
        """Generation's forward steps and whole programs are planned on one mesh: an
        intra-op plan, with the search's sharding options (there is no step to checkpoint
        or split)."""
        return ShardParallel(auto_sharding_option=method.auto_sharding_option,
                             optimizer=method.optimizer)
