"""The pipeline search: Alpa's stage DP, with the stages that decide it priced exactly.

A candidate stage (layer range, submesh, micro-batches in flight) has variants: each
logical view, kept or recomputed (``passes/pipeline_search/stage_recompute.py``). Each variant starts at its
additive estimate (``passes/pipeline_search/stage_costs.py``), or, where that says "does not fit" but is
near fitting, at the fastest additive plan's latency (optimistic); the candidate costs its
cheapest variant (``VariantTable``). Each round runs the DP (``passes/pipeline_search/stages.py``), then
prices the variant each stage of its answer took, if not yet priced, with the stage's own
memory-constrained ILP (``passes/pipeline_search/exact_stages.py``) and replaces that variant's estimate
by it (inf if no plan fits), so the candidate falls back to its next variant (another view,
recomputation) when the exact plan is slower or does not fit. When every stage of an
answer is exact, the uniform partitions (``uniform_layouts``: a hand grid's stage split)
whose estimates come within ``UNIFORM_MARGIN`` of it are priced exactly too, once, and the
rounds go on until an answer is exact again: the per-layer sums miss a stage's cross-layer
savings, and this way the answer is never slower than such a uniform partition planned by
the same stage ILP. With measured layer times (``stage_option="profile"``) the DP runs once
on them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from torchalpa.core.cluster import Cluster, Submesh, View
from torchalpa.core.options import AutoShardingOption
from torchalpa.core.switches import PassSwitches
from torchalpa.passes.pipeline_search.exact_stages import ExactStages
from torchalpa.passes.pipeline_search.search_keys import Chosen, GivenStage, Stage, Variant
from torchalpa.passes.pipeline_search.stage_costs import Candidate, StageCosts
from torchalpa.passes.pipeline_search.stage_jobs import StageJobs
from torchalpa.passes.pipeline_search.stages import PipelineSolution, stage_dp

__all__ = ["StageSearch", "SearchResult", "VariantTable", "uniform_layouts", "MEMORY_SLACK",
           "UNIFORM_MAX_NODES", "MAX_EXACT_ROUNDS", "UNIFORM_MARGIN", "BOUND_TOLERANCE"]

log = logging.getLogger("torchalpa.planner")

MEMORY_SLACK = 2.0
"""How far over the budget an additive memory estimate may be for the exact stage ILP to
be asked (GPT-39B, 2 layers, 8 micro-batches in flight: additive 126-140 GB, exact 79 GB
of 80)."""

UNIFORM_MAX_NODES: int | None = 500
"""Branch-and-bound nodes each ILP solve of a uniform partition's stage may explore
(``StageSearch``), in place of the method's ``max_nodes`` where that is larger; None: no
bound of its own. Those stages are priced only to offer the search an alternative, so
their solves stop early (here, and where their plan is proved within
``stage_solve.BUDGETED_GAP`` of the optimum): any feasible plan's time is an upper bound
of the stage's optimum. Bounds by work, not seconds, so the same search prices them alike
at any load (the method's ``time_limit`` stays the safety net, reported in the plan's
notes)."""

BOUND_TOLERANCE = 1e-9
"""How far (relative) a variant's LP bound must be above its stage's exact price for the
rounds to leave it unsolved (``StageSearch._cut_by_bounds``): the bound and a solve's
price are sums of the same costs in another order (a GPT stage's bound can equal its
price), so rounding must not cut a variant that ties or beats it."""

MAX_EXACT_ROUNDS = 8
"""Rounds of (stage DP, exact pricing of the stages it chose that were not yet exact)."""

UNIFORM_MARGIN = 0.02
"""How far above the search's exact answer a uniform partition's additive estimate may be
for its stages to be priced exactly too (``uniform_layouts``). The per-layer sums miss
what a stage's own ILP saves across its layers (GPT-15B's two-layer stages on (1, 8) as
(2, 4): dearer by the sums, cheaper exactly), so a uniform partition the sums rank just
behind the answer may beat it; ``math.inf`` prices every uniform partition."""

Key = tuple[int, int, int, int]
"""A candidate stage of the DP: (first layer, last layer, submesh index, in flight)."""
Pick = tuple[Key, Variant]
"""A candidate stage and the variant to price it as."""


@dataclass
class SearchResult:
    """The DP's answer, how each of its stages is planned, how many stage variants were
    priced exactly, and the uniform partitions whose stages were all priced exactly and
    fit (alternatives the assembly may find faster by the schedule's timeline)."""

    solution: PipelineSolution
    stages: list[Chosen]
    num_priced: int
    uniform: list[list[GivenStage]]


class VariantTable:
    """Each candidate stage's variants and their latencies, additive or exact, and which
    variant the DP's cost function took for each candidate it asked about."""

    def __init__(self, costs: StageCosts, shapes: list[Submesh], measured: bool):
        self.costs, self.shapes, self.measured = costs, shapes, measured
        # key -> (view, recompute) -> (latency, chosen or None when no plan fits)
        self.priced: dict[Key, dict[tuple[View, bool], tuple[float, Chosen | None]]] = {}
        # a variant's additive estimate does not change between rounds (only ``priced``)
        self._additive: dict[tuple[Key, bool], dict[tuple[View, bool],
                                                    tuple[float, Variant]]] = {}
        # a stage's additive candidates, shared by both ``guess`` settings and the
        # uniform partitions (target b: the rounds' last DP, ``guess`` off, priced every
        # stage's candidates again, 113k of them)
        self._candidates: dict[Key, list[Candidate]] = {}
        # (key, guess) -> ``cost``'s answer: (latency, variant taken), dropped when the
        # key is priced or cut
        self._costs: dict[tuple[Key, bool], tuple[float, tuple[Variant | Chosen, bool] |
                                                         None]] = {}
        # key -> (picked, exact?): an exact variant's Chosen, else the additive Variant
        self.choice: dict[Key, tuple[Variant | Chosen, bool] | None] = {}
        # key -> (view, recompute) -> LP bound of a variant left unsolved: above the key's
        # exact price (``StageSearch._cut_by_bounds``), so never the key's cheapest
        self.cut: dict[Key, dict[tuple[View, bool], float]] = {}

    def cost(self, key: Key, guess: bool = True) -> float:
        """A stage's latency: its cheapest variant, exact where it was priced so, else the
        per-layer sum or, with ``guess``, the optimistic estimate (a stage the sum calls
        too big, to be priced exactly if the DP picks it). Records the variant taken.
        Kept until the stage is priced or cut again: each round's DP asks for every stage
        (target b: 113k), and a round prices a few dozen."""
        found = self._costs.get((key, guess))
        if found is None:
            found = self._costs[key, guess] = self._cheapest(key, guess)
        self.choice[key] = found[1]
        return found[0]

    def _cheapest(self, key: Key, guess: bool
                  ) -> tuple[float, tuple[Variant | Chosen, bool] | None]:
        """``cost``'s answer worked out: (latency, (variant taken, exact?) or None)."""
        best: tuple[float, tuple[Variant | Chosen, bool] | None] = (math.inf, None)
        priced, cut = self.priced.get(key, {}), self.cut.get(key, {})
        for variant, (latency, chosen) in self._additive_of(key, guess).items():
            if variant not in priced and variant not in cut and latency < best[0]:
                best = (latency, (chosen, False))
        for latency, chosen in priced.values():
            if chosen is not None and latency < best[0]:
                best = (latency, (chosen, True))
        return best

    def _additive_of(self, key: Key, guess: bool) -> dict[tuple[View, bool],
                                                           tuple[float, Variant]]:
        found = self._additive.get((key, guess))
        if found is None:
            found = self._additive[key, guess] = variants(
                self.costs, self.candidates(key), guess and not self.measured)
        return found

    def candidates(self, key: Key) -> list[Candidate]:
        """``StageCosts.candidates`` of stage ``key``, computed once."""
        found = self._candidates.get(key)
        if found is None:
            k, i, j, flight = key
            found = self._candidates[key] = self.costs.candidates(k, i, self.shapes[j],
                                                                  flight)
        return found

    def guess(self, key: Key, view: View, recompute: bool) -> float:
        """The estimate (additive, or optimistic where near fitting) the DP priced a
        variant at before it is priced exactly (inf: none)."""
        found = self._additive_of(key, True).get((view, recompute))
        return math.inf if found is None else found[0]

    def record(self, key: Key, view: View, recompute: bool, latency: float,
               option: AutoShardingOption | None) -> None:
        """Replace a variant's estimate by its exact price (inf: no plan fits)."""
        self.priced.setdefault(key, {})[view, recompute] = (
            latency, Chosen(view, option, recompute) if math.isfinite(latency) else None)
        self._forget(key)

    def _forget(self, key: Key) -> None:
        """Drop ``cost``'s kept answers for ``key`` (its prices or cuts changed)."""
        self._costs.pop((key, True), None)
        self._costs.pop((key, False), None)

    def picked(self, key: Key) -> tuple[Variant | Chosen, bool]:
        """The variant the DP took for ``key`` and whether it is exact."""
        picked = self.choice[key]
        assert picked is not None, "the DP chose a stage with no plan"
        return picked

    def best_exact(self, key: Key) -> float:
        """The cheapest exact price of ``key``'s variants priced so far (inf: none fits or
        none was priced)."""
        return min((latency for latency, chosen in self.priced.get(key, {}).values()
                    if chosen is not None), default=math.inf)

    def record_cut(self, key: Key, view: View, recompute: bool, bound: float) -> None:
        """Leave a variant unsolved: its LP ``bound`` is above ``key``'s exact price."""
        self.cut.setdefault(key, {})[view, recompute] = bound
        self._forget(key)

    def snapshot(self) -> tuple[dict, dict, dict]:
        return {key: dict(priced) for key, priced in self.priced.items()}, \
            dict(self.choice), dict(self._costs)

    def restore(self, saved: tuple[dict, dict, dict]) -> None:
        self.priced.clear()
        self.priced.update(saved[0])
        self.choice.clear()
        self.choice.update(saved[1])
        self._costs = dict(saved[2])

    def num_priced(self) -> int:
        return sum(len(v) for v in self.priced.values())

    def view_best(self, key: Key, view: View) -> tuple[float, Variant, bool] | None:
        """The cheapest variant (kept or recomputed) of stage ``key`` on ``view``:
        (latency, (view, lean, recompute), exact?), exact where priced, else the additive
        estimate (optimistic where near fitting), or a variant's LP bound where the rounds
        cut it (a uniform partition then prices it as any other unpriced stage of it);
        None if no variant on ``view`` may fit."""
        priced, cut = self.priced.get(key, {}), self.cut.get(key, {})
        best = None
        for (v, recompute), (latency, chosen) in variants(self.costs, self.candidates(key),
                                                          True).items():
            if v != view:
                continue
            if (v, recompute) in priced:
                latency, found = priced[v, recompute]
                if found is None:
                    continue
                candidate = (latency, chosen, True)
            else:
                candidate = (cut.get((v, recompute), latency), chosen, False)
            if best is None or candidate[0] < best[0]:
                best = candidate
        return best

    def exact_on(self, key: Key, view: View) -> Chosen | None:
        """The fastest variant of ``key`` on ``view`` priced exactly and fitting."""
        found = [(latency, chosen) for (v, _), (latency, chosen)
                 in self.priced.get(key, {}).items() if v == view and chosen is not None]
        return min(found, key=lambda f: f[0])[1] if found else None


class StageSearch:
    """Rounds of the stage DP and exact pricing (see module doc) of ``costs``' layers on
    the submeshes ``shapes`` of ``cluster``, ``num_micro_batches`` per step under
    ``schedule``; exact solves by ``exact``, ``workers`` at a time."""

    def __init__(self, costs: StageCosts, exact: ExactStages, cluster: Cluster,
                 num_micro_batches: int, schedule: str, shapes: list[Submesh], workers: int):
        self.costs, self.exact, self.cluster = costs, exact, cluster
        self.num_layers = costs.problem.num_layers
        self.num_micro_batches, self.schedule, self.shapes = num_micro_batches, schedule, shapes
        self.workers = workers
        self.measured = costs.layers.measured is not None
        self.table = VariantTable(costs, shapes, self.measured)
        self._round_picks: list[Pick] = []     # the DP's picks priced this round
        self.num_cut = 0        # variants the rounds left unsolved by their LP bounds
        self.dp_work = [0, 0, 0]    # stage DP runs, bounds they ran, candidates compared

    def run(self) -> SearchResult:
        """The search's answer (``ValueError`` if no stage fits)."""
        jobs = StageJobs(self.exact.solve_in_worker, self.workers)
        try:
            solution = self._rounds(jobs)
        finally:
            jobs.close()
            log.info("pipeline search: %d stage solves guessed while a worker was idle, %d "
                     "of them asked for, %d stopped; %d stage variants left unsolved by their"
                     " LP bounds (%d bounds)", jobs.guessed, jobs.guesses_used,
                     jobs.guesses_stopped, self.num_cut, self.exact.bounded)
            log.info("pipeline search: %d stage DP runs over %d bounds, %d candidates "
                     "compared", *self.dp_work)
        return SearchResult(solution, self._chosen(solution), self.table.num_priced(),
                            self._uniform_exact())

    def _rounds(self, jobs: StageJobs) -> PipelineSolution:
        """DP, exact pricing of what it picked not yet exact, again; once an answer is
        exact, the uniform partitions that might beat it priced too (each solve within
        ``UNIFORM_MAX_NODES``), and again until an answer is exact."""
        uniform_done = self.measured     # measured times are not repriced by the cost model
        for _ in range(MAX_EXACT_ROUNDS + 1):
            solution = self._dp()
            picks, budget = self._inexact_picks(solution), None
            if not picks and not uniform_done:
                uniform_done = True
                picks = self._uniform_picks(solution.total * (1 + UNIFORM_MARGIN))
                budget = UNIFORM_MAX_NODES
            if not picks or self.measured:
                return solution
            self._round_picks = picks if budget is None else []
            self._price(picks, budget, jobs)
        # rounds spent: keep what was priced exactly, drop the optimistic guesses
        return self._dp(guess=False)

    def _dp(self, guess: bool = True) -> PipelineSolution:
        found = stage_dp(self.num_layers, self.cluster.num_nodes,
                         self.cluster.devices_per_node, self.num_micro_batches,
                         lambda k, i, j, after: self.table.cost((k, i, j, self._flight(after)),
                                                                guess))
        work = (1, found.num_t_max_tried, found.num_candidates)
        self.dp_work = [a + b for a, b in zip(self.dp_work, work)]
        return found

    def _flight(self, after: int) -> int:
        """Micro-batches in flight on a stage with ``after`` stages after it."""
        B = self.num_micro_batches
        return min(B, after + 1) if self.schedule == "1f1b" else B

    def _keys(self, solution: PipelineSolution) -> list[Key]:
        return [(st.layers[0], st.layers[1], self.shapes.index(st.submesh),
                 self._flight(len(solution.stages) - 1 - n))
                for n, st in enumerate(solution.stages)]

    def _inexact_picks(self, solution: PipelineSolution) -> list[Pick]:
        """The stages of ``solution`` whose variant is not priced exactly yet."""
        out: list[Pick] = []
        for key in self._keys(solution):
            picked, is_exact = self.table.picked(key)
            if not is_exact:
                assert isinstance(picked, Variant)     # additive: a Variant; exact: a Chosen
                out.append((key, picked))
        return out

    def _price(self, picks: list[Pick], budget: int | None, jobs: StageJobs) -> None:
        """Price ``picks`` exactly (solves within ``budget`` branch-and-bound nodes each,
        if given), but those a round may leave unsolved by their bounds."""
        if budget is None:
            picks = self._cut_by_bounds(picks)
        self.exact.solve_stages([self._stage(key, view, recompute)
                                 for key, (view, _, recompute) in picks], jobs,
                                budget, self._next_round)
        for key, (view, _, recompute) in picks:
            guess = self.table.guess(key, view, recompute)
            latency, option = self.exact.exact(*self._stage(key, view, recompute), budget)
            self.table.record(key, view, recompute, latency, option)
            log.info("pipeline search: layers %d..%d on %s as %s, %d in flight%s%s: "
                     "estimated %.6g s, exact %.6g s", key[0], key[1], self.shapes[key[2]],
                     view, key[3], ", recomputed" if recompute else "",
                     f", budget {budget} nodes" if budget is not None else "", guess, latency)

    def _cut_by_bounds(self, picks: list[Pick]) -> list[Pick]:
        """``picks`` but the variants left unsolved: a variant not yet known whose stage
        already has an exact price (another view's, or kept where this one recomputes) and
        whose LP bound (``ExactStages.lower_bound``) is above that price. Its exact price
        could only be higher, so the stage's price, its cheapest variant, is the same
        either way, and the DP's answers too (a price equal to the one known would not
        have replaced it). GPT-15B on 4 x 8 H100 (weak-scaling row 15b): the rounds
        priced layers 0-3 and 4-7 on (2, 8) as (8, 2), then on (2, 8) and (4, 4), each
        dearer (1,021 s of the 1,253 s of exact solves; RESULTS.md). A cut variant is
        recorded with its bound (``VariantTable.record_cut``): the uniform partitions
        rank it by that and price it, within their node budget, where they may win."""
        if not PassSwitches.current().stage_bounds:
            return picks
        kept: list[Pick] = []
        for key, variant in picks:
            view, _, recompute = variant
            best, stage = self.table.best_exact(key), self._stage(key, view, recompute)
            if math.isfinite(best) and not self.exact.knows(stage):
                bound = self.exact.lower_bound(*stage)
                if bound > best * (1 + BOUND_TOLERANCE):
                    self.table.record_cut(key, view, recompute, bound)
                    self.num_cut += 1
                    log.info("pipeline search: layers %d..%d on %s as %s, %d in flight%s: "
                             "LP bound %.6g s above the stage's exact %.6g s: not solved",
                             key[0], key[1], self.shapes[key[2]], view, key[3],
                             ", recomputed" if recompute else "", bound, best)
                    continue
            kept.append((key, variant))
        return kept

    def _stage(self, key: Key, view: View, recompute: bool) -> Stage:
        k, i, j, flight = key
        return Stage(k, i, self.shapes[j], view, flight, recompute)

    def _next_round(self) -> list[Stage]:
        """The stages the DP's answer prices next if every stage of this round not yet
        solved turns out not to fit: what the next round asks for when those come in
        dearer than their estimates (GPT-39B: the first stage, memory-bound, on another
        view, then on a larger submesh)."""
        if not self._round_picks:
            return []
        saved = self.table.snapshot()
        try:
            for key, (view, _, recompute) in self._round_picks:
                latency, option = self.exact.known_exact(*self._stage(key, view, recompute))
                self.table.record(key, view, recompute, latency, option)
            guess = self._dp()
            return [self._stage(key, view, recompute)
                    for key, ((view, _, recompute), is_exact) in
                    ((key, self.table.picked(key)) for key in self._keys(guess))
                    if not is_exact]
        except ValueError:       # nothing fits
            return []
        finally:
            self.table.restore(saved)

    def _uniform_picks(self, bound: float) -> list[Pick]:
        """(key, (view, lean, recompute)) of the stages of every uniform partition whose
        cheapest stage variants on one view, exact where priced, total at most ``bound``
        by the DP's objective, and not yet priced exactly."""
        out = []
        for pp, j in uniform_layouts(self.num_layers, self.cluster, self.shapes):
            keys = self._uniform_keys(pp, j)
            for view in self.costs.layers.views(self.shapes[j]):
                found = [self.table.view_best(key, view) for key in keys]
                best = [b for b in found if b is not None]
                if len(best) < len(found):      # a stage of it has no variant that may fit
                    continue
                latencies = [b[0] for b in best]
                total = sum(latencies) + (self.num_micro_batches - 1) * max(latencies)
                log.info("pipeline search: uniform %d stages on %s as %s: %.6g s by the DP's"
                         " objective (%d of %d stages exact), bound %.6g s", pp, self.shapes[j],
                         view, total, sum(b[2] for b in best), pp, bound)
                if total <= bound:
                    out += [(key, b[1]) for key, b in zip(keys, best) if not b[2]]
        return out

    def _uniform_keys(self, pp: int, j: int) -> list[Key]:
        """The stages of the uniform partition into ``pp`` stages on submesh ``j``."""
        per = self.num_layers // pp
        return [(s * per, (s + 1) * per - 1, j, self._flight(pp - 1 - s)) for s in range(pp)]

    def _uniform_exact(self) -> list[list[GivenStage]]:
        """Every uniform partition whose stages on one view were all priced exactly and
        fit, as stages ((first, last), submesh, view, option, recompute)."""
        out = []
        for pp, j in uniform_layouts(self.num_layers, self.cluster, self.shapes):
            for view in self.costs.layers.views(self.shapes[j]):
                stages = []
                for key in self._uniform_keys(pp, j):
                    chosen = self.table.exact_on(key, view)
                    if chosen is None:
                        break
                    stages.append(GivenStage((key[0], key[1]), self.shapes[j], view,
                                             chosen.option, chosen.recompute))
                else:
                    out.append(stages)
        return out

    def _chosen(self, solution: PipelineSolution) -> list[Chosen]:
        """How each stage of ``solution`` is planned: its exact variant's, or, where the
        DP ran on measured times, its additive variant's (view, option, recompute)."""
        stages: list[Chosen] = []
        for key in self._keys(solution):
            picked, is_exact = self.table.picked(key)
            if is_exact:
                assert isinstance(picked, Chosen)
                stages.append(picked)
            else:
                view, lean, recompute = picked
                stages.append(Chosen(view, replace(
                    self.costs.problem.method.auto_sharding_option, parameters="sharded")
                    if lean else None, recompute))
        return stages


def uniform_layouts(L: int, cluster: Cluster, shapes: list[Submesh]) -> list[tuple[int, int]]:
    """(stages, submesh index) of every uniform partition: ``stages`` dividing the
    layer count, each stage on the same submesh shape, ``stages`` of them tiling the
    cluster (a hand grid's pp and dp x tp devices per stage)."""
    return [(pp, j) for pp in range(1, L + 1) if L % pp == 0
            for j, (n, m) in enumerate(shapes) if n * m * pp == cluster.num_devices]


def variants(costs: StageCosts, candidates: list[Candidate], guess: bool
             ) -> dict[tuple[View, bool], tuple[float, Variant]]:
    """(view, recompute) -> (latency, (view, lean, recompute)) of the variants among a
    stage's ``candidates`` (``StageCosts.candidates``) that fit by the additive estimate,
    or, with ``guess``, are within ``MEMORY_SLACK`` x the budget of fitting: the fastest
    such plan per variant."""
    limit = (MEMORY_SLACK if guess else 1.0) * costs.problem.budget()
    out: dict[tuple[View, bool], tuple[float, Variant]] = {}
    for c in candidates:
        if c.memory <= limit and ((c.view, c.recompute) not in out or
                                  c.latency < out[c.view, c.recompute][0]):
            out[c.view, c.recompute] = (c.latency, c.variant)
    return out
