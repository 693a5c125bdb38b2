"""Exact stage prices: a range of layers as one stage, planned by its own memory-constrained ILP.

The stage DP's additive estimates (``passes/pipeline_search/stage_costs.py``) miss what a stage's own ILP
saves across its layers and how its micro-batches in flight share the memory; the search
prices the stages the DP picks exactly here (``exact``), by ``passes/pipeline_search/stage_solve.py``. The
solves are cached by the range's structure (``SearchProblem.range_shape``), so ranges of
identical layers are solved once, and a solve with fewer micro-batches in flight answers
more where its plan still fits (``_reuse_fewer_in_flight``). ``solve_stages`` runs a
round's solves in forked workers (``passes/pipeline_search/stage_jobs.py``), and keeps the plans made so
that the final plan's assembly reuses them, or moves them onto identical layers elsewhere
(``donated``, ``passes/pipeline_search/transplant.py``). A stage the solver proves no plan fits
is not solved again with sharded states, and one whose memory floor is above its budget
(``stage_solve.cannot_fit``) is not solved at all (``_solve_stage``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace

from torchalpa.core.cluster import LogicalMesh, Submesh, View
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import AutoShardingOption
from torchalpa.core.plan import Plan
from torchalpa.core.plan_records import known
from torchalpa.core.switches import PassSwitches
from torchalpa.passes.pipeline_search.layer_cache import SolveCache
from torchalpa.passes.pipeline_search.layer_costs import micro_batch_seconds
from torchalpa.passes.pipeline_search.search_keys import PlanKey, Stage
from torchalpa.passes.pipeline_search.search_problem import SearchProblem
from torchalpa.passes.pipeline_search.stage_costs import StageCosts
from torchalpa.passes.pipeline_search.stage_jobs import StageJobs
from torchalpa.passes.pipeline_search.stage_recompute import recompute_option, recompute_seconds
from torchalpa.passes.pipeline_search.stage_solve import (
    StageRequest,
    cannot_fit,
    plan_stage,
    polish_option,
    search_option,
    stage_time_lower_bound,
)
from torchalpa.passes.pipeline_search.transplant import transplant
from torchalpa.passes.pricing.memory import in_flight_bytes
from torchalpa.passes.sharding.ilp import InfeasibleError, MemoryNotSettled, SolverStopped
from torchalpa.passes.sharding.intra_op import least_memory_unsaid

__all__ = ["ExactStages"]

Memory = tuple[float, float, float]
"""A stage plan's model states, one micro-batch's activation peak and what it saves for
backward, per device."""
Solved = tuple[float | None, bool, Memory | None]
"""A stage solve's result: latency (None: nothing fits), lean, memory."""


class ExactStages:
    """Exact stage solves of ``problem``, cached in ``cache`` (see module doc).
    ``exact_solves`` counts the ILP solves, ``reused_in_flight`` the solves answered from
    fewer micro-batches in flight, ``transplanted`` the plans moved onto identical layers,
    ``proved_unfit`` the stages whose sharded-states ILP was not run because the solver
    proved that none fits, ``floored`` the stages whose memory floor proved it before any
    ILP (``stage_solve.cannot_fit``); ``exact_plans`` holds this graph's stage plans by
    ``PlanKey``. Pricing work is kept in the layer estimates' ``memo``."""

    def __init__(self, problem: SearchProblem, costs: StageCosts, cache: SolveCache):
        self.problem, self.costs, self.cache = problem, costs, cache
        self.memo = costs.layers.memo
        self.exact_solves = 0
        self.reused_in_flight = 0
        self.transplanted = 0
        self.proved_unfit = 0
        self.floored = 0
        self.bounded = 0        # stage LP bounds computed (``lower_bound``)
        self.exact_plans: dict[PlanKey, Plan] = {}

    def exact(self, k: int, i: int, submesh: Submesh, view: View, in_flight_batches: int,
              recompute: bool = False, budget: int | None = None
              ) -> tuple[float, AutoShardingOption | None]:
        """Latency of layers k..i as one stage by its own memory-constrained ILP (with its
        micro-batches in flight) on ``view``, and the option that fits (None: the method's
        own; else sharded states); inf if neither fits. ``recompute``: the stage
        checkpointed (``passes/pipeline_search/stage_recompute.py``). ``budget``: branch-and-bound nodes each
        of the stage's ILP solves may explore at most (``search_option``). Cached by the range's structure,
        so ranges of identical layers are solved once, and reused from fewer micro-batches
        in flight where that plan still fits (``_reuse_fewer_in_flight``)."""
        received = self.costs.received(k, i) if recompute else None
        key = self._stage_key(k, i, submesh, view, in_flight_batches, recompute, budget)
        self._answer_budgeted_by_full(k, i, submesh, view, in_flight_batches, recompute,
                                      budget)
        if key not in self.cache:
            self._reuse_fewer_in_flight(k, i, submesh, view, in_flight_batches, recompute,
                                        budget)
        seconds, lean, _ = self.cache.get(key, lambda: self._solve_stage(
            k, i, submesh, view, in_flight_batches, received, budget))
        return self._priced_stage(k, i, seconds, lean, recompute, submesh, view)

    def _answer_budgeted_by_full(self, k: int, i: int, submesh: Submesh, view: View,
                                 flight: int, recompute: bool, budget: int | None) -> None:
        """A budgeted solve asked for where the full solve of the same stage is known:
        store that one for it (a budget only stops solves early, so the full plan is at
        least as good). GPT-39B's 64-device row: a uniform partition's layers 2-3 are the
        DP's layers 3-4, the same structure, already solved in full."""
        if budget is None:
            return
        key = self._stage_key(k, i, submesh, view, flight, recompute, budget)
        full = self._stage_key(k, i, submesh, view, flight, recompute)
        if key not in self.cache and full in self.cache:
            self.cache.put(key, self.cache.peek(full))

    def known_exact(self, k: int, i: int, submesh: Submesh, view: View,
                    in_flight_batches: int, recompute: bool = False
                    ) -> tuple[float, AutoShardingOption | None]:
        """``exact``'s answer (unbudgeted) where its solve, or one with fewer micro-batches
        in flight that decides it, is known already; inf where neither is. Solves and
        stores nothing."""
        flight = in_flight_batches
        if self._stage_key(k, i, submesh, view, flight, recompute) not in self.cache:
            flight = self._fewer_that_decides(k, i, submesh, view, flight, recompute, None)
            if flight is None:
                return math.inf, None
        seconds, lean, _ = self.cache.peek(
            self._stage_key(k, i, submesh, view, flight, recompute))
        return self._priced_stage(k, i, seconds, lean, recompute, submesh, view)

    def knows(self, stage: Stage) -> bool:
        """Whether ``exact`` answers ``stage`` (unbudgeted) without a solve: its solve, or
        one with fewer micro-batches in flight that decides it, is known."""
        return not self._is_open(self._stage_key(*stage), stage, None)

    def lower_bound(self, k: int, i: int, submesh: Submesh, view: View,
                    in_flight_batches: int, recompute: bool = False) -> float:
        """A latency ``exact`` cannot return below for this stage (-inf: no bound): the LP
        relaxation of the least simplified problem its solves or the polish of a picked
        stage may build
        (``stage_time_lower_bound``), as ``_priced_stage`` turns a solve into latency.
        Memory rows are not in it, so the micro-batches in flight, a recomputed stage's
        lower budget and sharded states (a subset of the strategies) only restrict the
        problems it bounds: one LP per range structure and view, cached beside the solves."""
        del in_flight_batches    # the bound holds for every count (see above)
        problem = self.problem
        key = ("stage bound", *problem.range_shape(k, i), view, submesh, problem.context)
        mesh = problem.mesh(submesh, view)

        def bound() -> float | None:
            self.bounded += 1
            method = problem.method
            try:
                return stage_time_lower_bound(StageRequest(
                    problem.stage_graph(k, i), mesh, method.intra_op_method(
                        polish_option(method.auto_sharding_option)), problem.inputs,
                    1, method.num_micro_batches), self.memo)
            except InfeasibleError:     # no plan of any problem it bounds, whatever fits
                return math.inf

        seconds = self.cache.get(key, bound)
        if seconds is None:
            return -math.inf
        if recompute:
            seconds = recompute_seconds(seconds)
        return seconds + self.costs.send_seconds(k, i, mesh)

    def _priced_stage(self, k: int, i: int, seconds: float | None, lean: bool,
                      recompute: bool, submesh: Submesh, view: View
                      ) -> tuple[float, AutoShardingOption | None]:
        """A stage solve's result as ``exact`` returns it: latency with its sends (inf if
        nothing fit; as laid out on ``view``) and the option that fits."""
        if seconds is None:
            return math.inf, None
        option = replace(self.problem.method.auto_sharding_option, parameters="sharded") \
            if lean else None
        if recompute:
            seconds = recompute_seconds(seconds)
        return seconds + self.costs.send_seconds(k, i, self.problem.mesh(submesh, view)), \
            option

    def _stage_key(self, k: int, i: int, submesh: Submesh, view: View, in_flight_batches: int,
                   recompute: bool, budget: int | None = None) -> tuple:
        """What ``exact`` caches a stage's solve under: its layers' structure, where it sits,
        its view, micro-batches in flight, and the node budget its solves ran under (a
        budgeted solve may stop short of the optimum a full one finds)."""
        return ("stage", *self.problem.range_shape(k, i), view, submesh, in_flight_batches,
                self.problem.context) + \
            ((("recompute", self.costs.received(k, i)),) if recompute else ()) + \
            ((("budget", budget),) if budget is not None else ())

    def _fits(self, memory: Memory, k: int, i: int, flight: int, recompute: bool) -> bool:
        """Whether a stage plan of layers k..i with ``memory`` (model states, one
        micro-batch's activation peak, what it saves for backward) fits the budget with
        ``flight`` micro-batches in flight, as ``plan_intra_op`` counts them (recomputed:
        one micro-batch planned in what the others' received inputs leave)."""
        state, peak, saved = memory
        if recompute:
            return in_flight_bytes(state, peak, saved, 1) <= \
                self.problem.budget() - (flight - 1) * self.costs.received(k, i)
        return in_flight_bytes(state, peak, saved, flight) <= self.problem.budget()

    def _reuse_fewer_in_flight(self, k: int, i: int, submesh: Submesh, view: View,
                               flight: int, recompute: bool, budget: int | None) -> bool:
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
        found = self.cache.peek(self._stage_key(k, i, submesh, view, fewer, recompute, budget))
        lean = found[1]
        plan = self.exact_plans.get(PlanKey(k, i, submesh, view, lean, fewer, recompute))
        self.cache.put(self._stage_key(k, i, submesh, view, flight, recompute, budget), found)
        if plan is not None:
            self.exact_plans[PlanKey(k, i, submesh, view, lean, flight, recompute)] = plan
        self.reused_in_flight += 1
        return True

    def _fewer_that_decides(self, k: int, i: int, submesh: Submesh, view: View, flight: int,
                            recompute: bool, budget: int | None) -> int | None:
        """The most micro-batches in flight, below ``flight``, whose solve of the stage
        decides it with ``flight`` (``_reuse_fewer_in_flight``); None if none does."""
        for fewer in range(flight - 1, 0, -1):
            key = self._stage_key(k, i, submesh, view, fewer, recompute, budget)
            if key not in self.cache:
                continue
            seconds, _, memory = self.cache.peek(key)
            if seconds is not None and not self._fits(memory, k, i, flight, recompute):
                continue
            return fewer
        return None

    def donated(self, k: int, i: int, submesh: Submesh, view: View, lean: bool, flight: int,
                recompute: bool, request: StageRequest) -> Plan | None:
        """A plan for layers k..i as a stage (``request``: what ``plan_stage`` would solve
        it from) moved from a solved plan of identical layers elsewhere
        (``passes/pipeline_search/transplant.py``) that is also this stage's best: one solved with as many
        micro-batches in flight, or with fewer and still fitting (the argument of
        ``_reuse_fewer_in_flight``). None if there is none."""
        shape = self.problem.range_shape(k, i)
        for key, plan in list(self.exact_plans.items()):
            if (key.submesh, key.view, key.lean, key.recompute) != (submesh, view, lean,
                                                                     recompute) \
                    or (key.first, key.last) == (k, i) or key.in_flight > flight \
                    or self.problem.range_shape(key.first, key.last) != shape:
                continue
            e = plan.estimates
            memory = (known(e.model_state_bytes_per_device),
                      known(e.activation_bytes_per_device),
                      known(e.saved_activation_bytes_per_device))
            if key.in_flight < flight and not self._fits(memory, k, i, flight, recompute):
                continue
            moved = transplant(plan, self.problem.stage_graph(key.first, key.last), request.graph,
                               request.mesh, request.method, request.inputs, self.memo,
                               request.micro_batches)
            if moved is not None:
                self.exact_plans[PlanKey(k, i, submesh, view, lean, flight, recompute)] = moved
                self.transplanted += 1
                return moved
        return None

    def solve_stages(self, stages: list[Stage], jobs: StageJobs, budget: int | None = None,
                     later: Callable[[], list[Stage]] = list) -> None:
        """Solve the stages that ``exact`` has not yet, by ``jobs`` (forked workers), and
        keep them where ``exact`` finds them: the DP's stages of one round are independent
        solves (one to two minutes each for GPT-15B's two-layer stages), run one after
        another before. A range asked for at several micro-batches in flight is solved at
        the fewest first, in waves, so that the others may follow from it
        (``_reuse_fewer_in_flight``); a wave with fewer ranges than workers also solves the
        most-in-flight of them, and a worker left idle within a wave guesses the next
        wave's solves, then the stages ``later`` says later rounds may ask for
        (``StageJobs``: guesses change the search's time, never its answer). ``budget``:
        as in ``exact``."""
        todo = self._unsolved(stages, budget)
        jobs.on_result = self._store
        jobs.guess = functools.partial(self._guesses, todo, budget, later)
        while todo:
            answered = [key for key, stage in todo.items()
                        if self._reuse_fewer_in_flight(*stage, budget)]
            for key in answered:
                del todo[key]
            wave = self._wave(todo, budget, jobs.workers)
            jobs.solve([(key, self._job(stage, budget)) for key, stage in wave])
            for key, _ in wave:
                del todo[key]

    def _unsolved(self, stages: list[Stage], budget: int | None) -> dict[tuple, Stage]:
        """``stages`` by their cache key, but those ``exact`` knows already."""
        todo: dict[tuple, Stage] = {}
        for stage in stages:
            self._answer_budgeted_by_full(*stage, budget)
            key = self._stage_key(*stage, budget)
            if key not in self.cache and key not in todo:
                todo[key] = stage
        return todo

    def _wave(self, todo: dict[tuple, Stage], budget: int | None, workers: int
              ) -> list[tuple[tuple, Stage]]:
        """The solves to run next: each range at its fewest micro-batches in flight, and,
        for workers that would be idle, the most in flight of a range (the solve the
        fewest one is least likely to answer)."""
        fewest: dict[tuple, tuple[tuple, Stage]] = {}
        for key, stage in sorted(todo.items(), key=lambda item: item[1].in_flight):
            k, i, submesh, view, _, recompute = stage
            fewest.setdefault(self._stage_key(k, i, submesh, view, 0, recompute, budget),
                              (key, stage))
        wave = list(fewest.values())
        spare = sorted((item for item in todo.items() if item not in wave),
                       key=lambda item: -item[1].in_flight)
        return wave + spare[:max(0, workers - len(wave))]

    def _guesses(self, todo: dict[tuple, Stage], budget: int | None,
                 later: Callable[[], list[Stage]]) -> list[tuple[tuple, tuple]]:
        """What an idle worker may solve ahead: the next wave first, the most in flight of
        a range (which the fewest one answers least often); then what later rounds may
        ask for."""
        wave = sorted((item for item in todo.items() if self._is_open(*item, budget)),
                      key=lambda item: -item[1].in_flight)
        rounds = [(self._stage_key(*stage), stage) for stage in later()]
        return [(key, self._job(stage, budget)) for key, stage in wave] + \
            [(key, self._job(stage, None)) for key, stage in rounds
             if self._is_open(key, stage, None)]

    def _is_open(self, key: tuple, stage: Stage, budget: int | None) -> bool:
        """Whether no solve known so far answers ``stage``."""
        return key not in self.cache and \
            self._fewer_that_decides(*stage, budget) is None

    def _job(self, stage: Stage, budget: int | None) -> tuple:
        """``solve_in_worker``'s arguments for ``stage``."""
        k, i, submesh, view, flight, recompute = stage
        return (k, i, submesh, view, flight, self.costs.received(k, i) if recompute else None,
                budget)

    def _store(self, key: tuple, value: tuple) -> None:
        """Keep what ``solve_in_worker`` returned for the stage cached under ``key``."""
        result, plans, (solves, proved, floored) = value
        self.cache.put(key, result)
        self.exact_plans.update(plans)
        self.exact_solves += solves
        self.proved_unfit += proved
        self.floored += floored

    def solve_in_worker(self, job: tuple) -> tuple[Solved, dict[PlanKey, Plan],
                                                   tuple[int, int, int]]:
        """``_solve_stage`` of ``job`` in a forked worker: its result, the stage plans it
        made and its counts (``exact_solves``, ``proved_unfit``, ``floored``; the worker's
        own copy of this object is dropped with it)."""
        had = set(self.exact_plans)
        counts = (self.exact_solves, self.proved_unfit, self.floored)
        result = self._solve_stage(*job)
        made = {key: plan for key, plan in self.exact_plans.items() if key not in had}
        counted = (self.exact_solves - counts[0], self.proved_unfit - counts[1],
                   self.floored - counts[2])
        # the caller adds ``counted``: undo it here, where ``StageJobs`` ran this in the
        # searching process itself (one worker, or JAX loaded) and ``self`` is the
        # caller's own object, not a copy
        self.exact_solves, self.proved_unfit, self.floored = counts
        return result, made, counted

    def _floored(self, sub: OpGraph, mesh: LogicalMesh, flight: int,
                 received: float | None) -> bool:
        """Whether the stage ``sub`` on ``mesh`` (``_solve_stage``'s) is proved not to fit
        by its memory floor (``stage_solve.cannot_fit``), counted in ``floored``: its
        first solve's request, whose strategies and budget hold for the sharded-states
        one too (a subset of the strategies, the same budget)."""
        if not PassSwitches.current().stage_floor:
            return False
        method = self.problem.method
        option = method.auto_sharding_option
        if received is not None:
            lowered = recompute_option(option, self.problem.budget(), received, flight)
            if lowered is None:
                return False        # ``_solve_stage`` returns inf itself
            option = lowered
        request = StageRequest(sub, mesh, method.intra_op_method(option), self.problem.inputs,
                               1 if received is not None else flight, method.num_micro_batches)
        if not cannot_fit(request, self.memo):
            return False
        self.floored += 1
        return True

    def _solve_stage(self, k: int, i: int, submesh: Submesh, view: View,
                     in_flight_batches: int, received: float | None,
                     budget: int | None = None) -> Solved:
        """The stage's exact plan, kept (``received`` None) or recomputed: then planned
        with one micro-batch in flight within the budget the others' inputs leave.
        ``budget``: branch-and-bound nodes each ILP solve may explore at most
        (``search_option``).
        Returns (latency, lean, (model states, activation peak, saved activations) per
        device), latency None where nothing fits.

        The sharded-states solve (``lean``) follows only where the first one ended without
        a proof that no plan fits (its clock, ``SolverStopped``, or its memory rounds,
        ``MemoryNotSettled``). A proof (the solver found its ILP, with memory rows at some
        points, infeasible) holds for sharded states too: ``parameters="sharded"`` only
        keeps a subset of each parameter's strategies (``apply_constraints``), every
        other strategy, memory row and budget is the same, and the first solve's proof
        is on its least restricted grouping (free followers, or the merged one where
        that frees none), which the sharded solve's groupings restrict further."""
        method = self.problem.method
        sub = self.problem.stage_graph(k, i)
        mesh = self.problem.mesh(submesh, view)
        if self._floored(sub, mesh, in_flight_batches, received):
            return None, False, None
        for lean in (False, True):
            option = replace(method.auto_sharding_option, parameters="sharded") \
                if lean else None
            if received is not None:
                option = recompute_option(option or method.auto_sharding_option,
                                          self.problem.budget(), received, in_flight_batches)
                if option is None:
                    return None, False, None
            option = search_option(option or method.auto_sharding_option, budget, len(sub))
            self.exact_solves += 1
            try:
                # a stage that does not fit is only skipped: its least memory unsolved
                with least_memory_unsaid():
                    plan = plan_stage(StageRequest(
                        sub, mesh, method.intra_op_method(option), self.problem.inputs,
                        1 if received is not None else in_flight_batches,
                        method.num_micro_batches), self.memo)
            except (SolverStopped, MemoryNotSettled):
                continue        # not a proof that none fits
            except InfeasibleError:
                if lean or not PassSwitches.current().trust_proofs:
                    continue
                self.proved_unfit += 1
                return None, False, None
            self.exact_plans[PlanKey(k, i, submesh, view, lean, in_flight_batches,
                                     received is not None)] = plan
            e = plan.estimates
            return micro_batch_seconds(e, method.num_micro_batches), lean, (
                known(e.model_state_bytes_per_device), known(e.activation_bytes_per_device),
                known(e.saved_activation_bytes_per_device))
        return None, False, None
