"""Polishing the picked stages (``passes/pipeline_search/stage_solve.py``: ``polished``,
``POLISH_BELOW``): the search solves no stage unsimplified; the stages of the pipeline it
assembles are re-solved so after, the better plan kept. A polished stage is never slower
than the search's plan of it, and where the re-solve is slower the search's plan stays."""

from __future__ import annotations

from dataclasses import replace

import pytest
from search_models import late_layers_stage, small_cluster, small_gpt_graph, small_pipeline

import torchalpa
from torchalpa.core.plan_records import known
from torchalpa.passes.pipeline_search import stage_solve
from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
from torchalpa.passes.pipeline_search.stage_solve import (
    StageRequest,
    plan_stage,
    polished,
    polishes,
    search_option,
    stage_seconds,
)


@pytest.fixture(scope="module")
def request_():
    """Layers 2..3 of the 4-layer small GPT as one stage on 4 devices viewed as (4,), two
    micro-batches in flight of 8 (where the simplified ILP's merge costs 4 %,
    ``tests/test_free_followers.py``)."""
    sub, mesh = late_layers_stage()
    option = torchalpa.AutoShardingOption(solver="highs")
    return StageRequest(sub, mesh,
                        torchalpa.ShardParallel(auto_sharding_option=option), "global", 2, 8)


def _with(request: StageRequest, **option) -> StageRequest:
    method = request.method
    return replace(request, method=replace(method, auto_sharding_option=replace(
        method.auto_sharding_option, **option)))


def test_the_search_solves_this_stage_without_the_unsimplified_re_solve(request_):
    assert polishes(request_)
    option = search_option(request_.method.auto_sharding_option, None, len(request_.graph))
    assert option.exact_below == 0


def test_polish_betters_a_merged_plan_and_is_the_polish_options_own_plan(request_):
    """From the simplified ILP's plan (followers merged: 4 % slower in its step, less in
    seconds per micro-batch), the polish returns the plan ``polish_option`` solves, and it
    is faster."""
    merged = plan_stage(_with(request_, exact_below=0, free_followers_below=0))
    polish = polished(request_, merged)
    again = plan_stage(_with(request_, exact_below=stage_solve.POLISH_BELOW))
    assert stage_seconds(polish, request_) < stage_seconds(merged, request_)
    assert polish.to_json() == again.to_json() or \
        stage_seconds(polish, request_) == stage_seconds(again, request_)


def test_polish_never_makes_a_stage_slower(request_, monkeypatch):
    """Where the re-solve finds a slower plan (here made to: it returns the merged plan),
    the search's own plan is kept, the very object."""
    freed = plan_stage(_with(request_, exact_below=0))
    merged = plan_stage(_with(request_, exact_below=0, free_followers_below=0))
    assert stage_seconds(merged, request_) > stage_seconds(freed, request_)
    monkeypatch.setattr(stage_solve, "plan_stage", lambda request, memo=None: merged)
    assert polished(request_, freed) is freed


def test_a_polish_that_cannot_fit_keeps_the_plan_and_solves_no_least_memory(
        request_, monkeypatch):
    """A re-solve with no plan within the budget (here a budget of 10 kB) keeps the search's
    plan; the least memory a plan would need, which nobody reads there, is not solved (up
    to 20 ILPs, ``intra_op._minimum_memory``)."""
    from torchalpa.passes.sharding import intra_op
    found = plan_stage(_with(request_, exact_below=0))
    calls: list[object] = []
    real = intra_op._minimum_memory
    monkeypatch.setattr(intra_op, "_minimum_memory",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    tight = _with(request_, memory_budget_per_device=10_000)
    with pytest.raises(intra_op.InfeasibleError, match="needs at least"):
        plan_stage(tight)   # said where a caller sees it
    calls.clear()
    assert polished(tight, found) is found
    assert calls == []


def test_a_searched_pipeline_is_polished_never_slower_and_says_so(monkeypatch):
    """The small GPT's pipeline search, polished and not (``POLISH_BELOW`` 0: the same
    search, the same stages picked): each stage's plan polished is at most as slow, the
    step too, and the plan's notes say how many stages were polished."""
    graph = small_gpt_graph(2)

    def search():
        return plan_pipeline(graph, small_cluster(), small_pipeline(2), workers=1)

    plan = search()
    monkeypatch.setattr(stage_solve, "POLISH_BELOW", 0)
    rough = search()
    assert [(s.layers, s.submesh) for s in plan.stages] == \
        [(s.layers, s.submesh) for s in rough.stages]
    for s, r in zip(plan.stages, rough.stages):
        assert known(s.plan.estimates.step_time_s) <= known(r.plan.estimates.step_time_s) \
            * (1 + 1e-12)
    assert known(plan.estimates.step_time_s) <= known(rough.estimates.step_time_s) * \
        (1 + 1e-12)
    assert any(n.startswith("polished ") and "of the search's stage plans" in n
               for n in plan.notes), plan.notes
    assert not any("polished" in n for n in rough.notes)
