"""The uniform partitions' stage solves run within their own time budget
(``stage_search.UNIFORM_TIME_LIMIT``); the stages the DP picks keep the method's time
limit. Every stage solve of the search skips the unsimplified re-solve on large stages
(``stage_solve.SEARCH_RESOLVE_BELOW``).

On GPT-15B the uniform partitions' unsimplified stage re-solves took most of the search
(20-85 s each, several at the 60 s limit) for stages at most 0.75 % faster."""

from __future__ import annotations

import math

import pytest
from search_models import small_gpt_graph

import torchalpa
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
BUDGET = 7.5      # seconds: far below the method's 60, never reached on this tiny model


@pytest.fixture(scope="module")
def gpt_graph():
    return small_gpt_graph()


def _search(graph, cache: SolveCache | None = None):
    """The search of ``graph`` in this process (one worker), its solves kept in ``cache``."""
    cluster = torchalpa.Cluster(num_nodes=2, devices_per_node=2, memory_per_device=0.05 * GB,
                                peak_flops=112e12, memory_bandwidth=900e9,
                                intra_node_bandwidth=100e9, intra_node_latency=1e-6,
                                inter_node_bandwidth=10e9, inter_node_latency=1e-5)
    method = torchalpa.PipeshardParallel(
        num_micro_batches=8, layer_option=torchalpa.AutoLayerOption(layer_num=4),
        auto_sharding_option=torchalpa.AutoShardingOption(solver="highs"))
    return plan_pipeline(graph, cluster, method, solves=cache, workers=1)


def _record_stage_plans(monkeypatch, record) -> None:
    """Have ``record(request)`` see every stage ILP plan, the search's and the assembly's."""
    plan_stage = stage_solve.plan_stage

    def recording_plan(request, memo=None):
        record(request)
        return plan_stage(request, memo)

    monkeypatch.setattr(exact_stages, "plan_stage", recording_plan)
    monkeypatch.setattr(pipeline_assembly, "plan_stage", recording_plan)


def test_uniform_stage_solves_use_the_budget_and_the_dp_stages_do_not(gpt_graph, monkeypatch):
    """Every stage solve asked for with a budget plans with that time limit, every other
    one with the method's 60 s; all re-solve unsimplified below ``SEARCH_RESOLVE_BELOW``
    nodes, not the method's 2000; with every uniform partition priced, some are
    budgeted."""
    monkeypatch.setattr(stage_search, "UNIFORM_MARGIN", math.inf)
    monkeypatch.setattr(stage_search, "UNIFORM_TIME_LIMIT", BUDGET)
    asked: list = []          # per stage solve: the budget it was given
    limits: list = []         # per stage ILP plan: (budget asked, time limit it ran with)
    solve_stage = ExactStages._solve_stage

    def recording_solve(self, k, i, submesh, view, flight, received, budget=None):
        asked.append(budget)
        return solve_stage(self, k, i, submesh, view, flight, received, budget)

    def record(request):
        option = request.method.auto_sharding_option
        limits.append((asked[-1], option.time_limit, option.exact_below))

    monkeypatch.setattr(ExactStages, "_solve_stage", recording_solve)
    _record_stage_plans(monkeypatch, record)
    plan = _search(gpt_graph)
    assert plan.estimates["memory_per_device_bytes"] <= 0.05 * GB
    # the stages record the capped re-solve they were planned with; stage_options, what
    # a user would pass per stage, leaves how hard the ILP worked out
    assert {s.plan.method["auto_sharding_option"]["exact_below"] for s in plan.stages} == \
        {stage_solve.SEARCH_RESOLVE_BELOW}
    assert not any("exact_below" in o or "time_limit" in o for o in plan.stage_options)
    assert BUDGET in asked, "no uniform partition's stage was priced under the budget"
    assert None in asked, "the DP priced no stage of its own"
    below = stage_solve.SEARCH_RESOLVE_BELOW
    assert below < 2000
    assert limits and all((limit, below) == ((BUDGET, below) if budget is not None else
                                             (60.0, below))
                          for budget, limit, below in limits), limits


def test_a_budget_bounds_the_time_limit_it_never_raises_it(monkeypatch):
    option = torchalpa.AutoShardingOption(solver="highs")          # time_limit 60 s
    monkeypatch.setattr(stage_solve, "SEARCH_RESOLVE_BELOW", 2000)
    assert stage_solve.search_option(option, None) is option
    assert stage_solve.search_option(option, 10.0).time_limit == 10.0
    assert stage_solve.search_option(option, 90.0).time_limit == 60.0
    unlimited = torchalpa.AutoShardingOption(solver="highs", time_limit=None)
    assert stage_solve.search_option(unlimited, 10.0).time_limit == 10.0
    assert stage_solve.search_option(option, 10.0).solver == "highs"
    assert option.exact_below == 2000
    monkeypatch.setattr(stage_solve, "SEARCH_RESOLVE_BELOW", 600)
    assert stage_solve.search_option(option, None).exact_below == 600
    assert stage_solve.search_option(option, None).time_limit == 60.0
    assert stage_solve.search_option(option, 10.0).exact_below == 600
    monkeypatch.setattr(stage_solve, "SEARCH_RESOLVE_BELOW", 0)
    assert stage_solve.search_option(option, 10.0).exact_below == 0
    small = torchalpa.AutoShardingOption(solver="highs", exact_below=300)
    monkeypatch.setattr(stage_solve, "SEARCH_RESOLVE_BELOW", 1000)
    assert stage_solve.search_option(small, 10.0).exact_below == 300


def test_budgeted_and_full_stage_solves_are_cached_apart(gpt_graph, monkeypatch):
    """A stage priced within a budget may stop short of what a full solve finds: the cache
    must not hand one for the other."""
    monkeypatch.setattr(stage_search, "UNIFORM_MARGIN", math.inf)
    monkeypatch.setattr(stage_search, "UNIFORM_TIME_LIMIT", BUDGET)
    cache = SolveCache()
    _search(gpt_graph, cache)
    stages = [key for key in list(cache._items) if key[0] == "stage"]
    budgeted = [key for key in stages if key[-1] == ("budget", BUDGET)]
    assert budgeted and len(budgeted) < len(stages)
    assert all(("budget", BUDGET) not in key[:-1] for key in stages)


def test_a_stage_solved_in_full_answers_its_budgeted_request(gpt_graph, monkeypatch):
    """A uniform partition's stage that the DP already solved in full (the same layers'
    structure, view and micro-batches in flight) is not solved again under the budget:
    the full plan answers it (a budget only stops solves early). Budgeted solves skip the
    alternating re-solve of repeated blocks; the DP's keep it."""
    monkeypatch.setattr(stage_search, "UNIFORM_MARGIN", math.inf)
    monkeypatch.setattr(stage_search, "UNIFORM_TIME_LIMIT", BUDGET)
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
