"""The uniform partitions' stage solves run within their own work budget, a node limit
(``stage_search.UNIFORM_MAX_NODES``) and a relative gap (``stage_solve.BUDGETED_GAP``);
the stages the DP picks keep the method's node limit and gap; both keep the method's time
limit (the safety net). No stage solve of the search re-solves unsimplified; the stages of
the pipeline assembled are polished so, up to ``stage_solve.POLISH_BELOW`` nodes.

On GPT-15B the uniform partitions' unsimplified stage re-solves took most of the search
(20-85 s each, several at the 60 s limit) for stages at most 0.75 % faster."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from search_models import small_cluster, small_gpt_graph, small_pipeline

import torchalpa
from torchalpa.core.plan import PipelinePlan
from torchalpa.passes.pipeline_search import (
    exact_stages,
    pipeline_assembly,
    stage_search,
    stage_solve,
)
from torchalpa.passes.pipeline_search.exact_stages import ExactStages
from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
from torchalpa.passes.pipeline_search.layer_cache import SolveCache

GB = 1024 ** 3
BUDGET = 300      # branch-and-bound nodes: far below the method's 2000
LAYERS = 2
"""The small GPT's layers: 2, not the 4 the other pipeline-search tests plan. Its uniform
partitions (1 or 2 stages) and the DP's stages still meet every case below, and the searches
take under a third of the CPU (about 23 s against 78 s for this file)."""


@pytest.fixture(scope="module")
def gpt_graph():
    return small_gpt_graph(LAYERS)


def _search(graph, cache: SolveCache | None = None):
    """The search of ``graph`` in this process (one worker), its solves kept in ``cache``."""
    return plan_pipeline(graph, small_cluster(), small_pipeline(LAYERS), solves=cache,
                         workers=1)


def _record_stage_plans(monkeypatch, record) -> None:
    """Have ``record(request)`` see every stage ILP plan, the search's and the assembly's."""
    plan_stage = stage_solve.plan_stage

    def recording_plan(request, memo=None):
        record(request)
        return plan_stage(request, memo)

    monkeypatch.setattr(exact_stages, "plan_stage", recording_plan)
    monkeypatch.setattr(pipeline_assembly, "plan_stage", recording_plan)


@dataclass(frozen=True)
class _Budgeted:
    """One search with every uniform partition priced under ``BUDGET`` nodes: its plan,
    the budget each stage solve was asked with, each stage ILP plan's (budget asked, node
    limit, time limit, exact_below, gap, graph nodes), and the solves it cached."""

    plan: PipelinePlan
    asked: list
    limits: list
    cache: SolveCache


@pytest.fixture(scope="module")
def budgeted(gpt_graph) -> _Budgeted:
    """The one search the two tests below read (the search is most of their time)."""
    asked: list = []
    limits: list = []
    solve_stage = ExactStages._solve_stage

    def recording_solve(self, k, i, submesh, view, flight, received, budget=None):
        asked.append(budget)
        return solve_stage(self, k, i, submesh, view, flight, received, budget)

    def record(request):
        option = request.method.auto_sharding_option
        limits.append((asked[-1], option.max_nodes, option.time_limit, option.exact_below,
                       option.gap, len(request.graph)))

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(stage_search, "UNIFORM_MARGIN", math.inf)
        monkeypatch.setattr(stage_search, "UNIFORM_MAX_NODES", BUDGET)
        monkeypatch.setattr(ExactStages, "_solve_stage", recording_solve)
        _record_stage_plans(monkeypatch, record)
        cache = SolveCache()
        plan = _search(gpt_graph, cache)
    return _Budgeted(plan, asked, limits, cache)


def test_uniform_stage_solves_use_the_budget_and_the_dp_stages_do_not(budgeted):
    """Every stage solve asked for with a budget plans with that node limit and stops at
    ``BUDGETED_GAP``, every other one with the method's 2000 nodes and the solver's own
    gap, all with the method's time limit (its safety net); none re-solves unsimplified
    where its graph is small enough to (``POLISH_BELOW`` nodes, not the method's 2000);
    the stages assembled are polished (re-solved so) after; with every uniform partition
    priced, some are budgeted."""
    plan, asked, limits = budgeted.plan, budgeted.asked, budgeted.limits
    assert plan.estimates.memory_per_device_bytes <= 0.05 * GB
    below = stage_solve.POLISH_BELOW
    assert below < 2000
    # the small GPT's stages are all small enough to polish: each records the polish's
    # re-solve, or the search's solve (none) where the polish found nothing faster;
    # stage_options, what a user would pass per stage, leaves how hard the ILP worked out
    assert all(s.plan.method["auto_sharding_option"]["exact_below"] in (below, 0)
               for s in plan.stages)
    assert any(n.startswith("polished ") and "of the search's stage plans" in n
               for n in plan.notes), plan.notes
    assert not any("exact_below" in o or "max_nodes" in o for o in plan.stage_options)
    assert BUDGET in asked, "no uniform partition's stage was priced under the budget"
    assert None in asked, "the DP priced no stage of its own"
    net = torchalpa.AutoShardingOption().time_limit     # the method's safety net
    gap = stage_solve.BUDGETED_GAP
    assert 0 < gap < stage_search.UNIFORM_MARGIN
    assert limits and all(
        (nodes, limit, resolve, stop) == ((BUDGET, net, 0 if size <= below else below, gap)
                                          if budget is not None else
                                          (2000, net, 0 if size <= below else below, None))
        for budget, nodes, limit, resolve, stop, size in limits), limits


def test_a_budget_bounds_the_node_limit_it_never_raises_it(monkeypatch):
    option = torchalpa.AutoShardingOption(solver="highs")          # max_nodes 2000
    monkeypatch.setattr(stage_solve, "POLISH_BELOW", 2000)
    assert stage_solve.search_option(option, None, 3000) is option
    assert stage_solve.search_option(option, 300).max_nodes == 300
    assert stage_solve.search_option(option, 3000).max_nodes == 2000
    assert stage_solve.search_option(option, 300).time_limit == option.time_limit
    unlimited = torchalpa.AutoShardingOption(solver="highs", max_nodes=None)
    assert stage_solve.search_option(unlimited, 300).max_nodes == 300
    assert stage_solve.search_option(option, 300).solver == "highs"
    assert option.gap is None and stage_solve.search_option(option, None).gap is None
    assert stage_solve.search_option(option, 300).gap == stage_solve.BUDGETED_GAP
    wide = torchalpa.AutoShardingOption(solver="highs", gap=0.05)    # a user's wider gap
    assert stage_solve.search_option(wide, 300).gap == 0.05
    assert stage_solve.search_option(wide, None).gap == 0.05
    assert option.exact_below == 2000
    monkeypatch.setattr(stage_solve, "POLISH_BELOW", 600)
    # a graph small enough to re-solve unsimplified is not (the polish does, if picked);
    # a larger one gets the polish's option, the same solve
    assert stage_solve.search_option(option, None, 600).exact_below == 0
    assert stage_solve.search_option(option, None, 601).exact_below == 600
    assert stage_solve.polish_option(option).exact_below == 600
    assert stage_solve.search_option(option, None).max_nodes == 2000
    assert stage_solve.search_option(option, 300, 700).exact_below == 600
    assert stage_solve.search_option(option, 300, 500).exact_below == 0
    monkeypatch.setattr(stage_solve, "POLISH_BELOW", 0)
    assert stage_solve.search_option(option, 300, 700).exact_below == 0
    small = torchalpa.AutoShardingOption(solver="highs", exact_below=300)
    monkeypatch.setattr(stage_solve, "POLISH_BELOW", 1000)
    assert stage_solve.search_option(small, 300, 700).exact_below == 300
    assert stage_solve.polish_option(small) is small


def test_budgeted_and_full_stage_solves_are_cached_apart(budgeted):
    """A stage priced within a budget may stop short of what a full solve finds: the cache
    must not hand one for the other."""
    stages = [key for key in list(budgeted.cache._items) if key[0] == "stage"]
    budgeted = [key for key in stages if key[-1] == ("budget", BUDGET)]
    assert budgeted and len(budgeted) < len(stages)
    assert all(("budget", BUDGET) not in key[:-1] for key in stages)


def test_a_stage_solved_in_full_answers_its_budgeted_request(gpt_graph, monkeypatch):
    """A uniform partition's stage that the DP already solved in full (the same layers'
    structure, view and micro-batches in flight) is not solved again under the budget:
    the full plan answers it (a budget only stops solves early). Budgeted solves skip the
    alternating re-solve of repeated blocks; the DP's keep it."""
    monkeypatch.setattr(stage_search, "UNIFORM_MARGIN", math.inf)
    monkeypatch.setattr(stage_search, "UNIFORM_MAX_NODES", BUDGET)
    solve_stage = ExactStages._solve_stage
    answer = ExactStages._answer_budgeted_by_full
    answered, asked, alternating = [], [], []

    def recording_answer(self, k, i, submesh, view, flight, recompute, budget):
        key = self._stage_key(k, i, submesh, view, flight, recompute, budget)
        before = key in self.cache
        answer(self, k, i, submesh, view, flight, recompute, budget)
        if budget is not None and not before and key in self.cache:
            answered.append(key)

    def recording_solve(self, k, i, submesh, view, flight, received, budget=None):
        if budget is not None:
            full = self._stage_key(k, i, submesh, view, flight, received is not None)
            assert full not in self.cache, f"layers {k}..{i} solved again under the budget"
        asked.append(budget)
        return solve_stage(self, k, i, submesh, view, flight, received, budget)

    def record(request):
        alternating.append((asked[-1], request.method.auto_sharding_option.alternate_blocks))

    solve_stages, full_stages = ExactStages.solve_stages, []

    def asking_again(self, stages, jobs, budget=None, later=list):
        # the tiny model's uniform partitions share no stage with the DP's answer: ask
        # under the budget for the DP's own stages too, as GPT-39B's uniform layers 2-3
        # (the DP's 3-4) were
        if budget is None:
            full_stages.extend(stages)
        else:
            stages = [*stages, *full_stages]
        return solve_stages(self, stages, jobs, budget, later)

    monkeypatch.setattr(ExactStages, "solve_stages", asking_again)
    monkeypatch.setattr(ExactStages, "_answer_budgeted_by_full", recording_answer)
    monkeypatch.setattr(ExactStages, "_solve_stage", recording_solve)
    _record_stage_plans(monkeypatch, record)
    _search(gpt_graph)
    assert len(answered) == len(set(full_stages)) > 0
    assert BUDGET in asked and None in asked
    assert {(budget, alternate) for budget, alternate in alternating} == \
        {(BUDGET, False), (None, True)}
