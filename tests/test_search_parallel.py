"""The pipeline search's exact stage solves run in worker processes plan what the search
solving them one after another in this process plans."""

from __future__ import annotations

import sys
import types

import pytest
from search_models import small_cluster, small_gpt_graph, small_pipeline

from torchalpa.passes.pipeline_search import inter_op
from torchalpa.passes.pipeline_search.stage_jobs import StageJobs


@pytest.fixture(scope="module")
def gpt_graph():
    return small_gpt_graph()


def _plan(graph, workers: int):
    return inter_op.plan_pipeline(graph, small_cluster(), small_pipeline(), workers=workers)


def test_stage_solves_in_workers_plan_the_same(gpt_graph, monkeypatch):
    pooled = []
    real_solve = StageJobs.solve

    def counting_solve(self, jobs):
        pooled.append((len(jobs), self.workers))
        return real_solve(self, jobs)

    monkeypatch.setattr(StageJobs, "solve", counting_solve)
    alone = _plan(gpt_graph, 1)
    assert all(workers == 1 for _, workers in pooled)      # solved here, one after another
    pooled.clear()
    together = _plan(gpt_graph, 2)
    assert max(items for items, _ in pooled) >= 2, "no round had two stages to solve at once"
    assert together.forward_stage_layer_ids == alone.forward_stage_layer_ids
    assert together.submesh_shapes == alone.submesh_shapes
    assert together.logical_shapes == alone.logical_shapes
    assert together.estimates.step_time_s == alone.estimates.step_time_s
    assert together.estimates.stage_solves == alone.estimates.stage_solves
    assert [s.plan.estimates.step_time_s for s in together.stages] == \
        [s.plan.estimates.step_time_s for s in alone.stages]


def test_stage_solves_counted_once_when_the_pool_runs_in_this_process(gpt_graph, monkeypatch):
    """With JAX loaded, the stages are solved here, one after another, whatever the
    workers: each is counted once, as forked workers count them (it was counted twice)."""
    alone = _plan(gpt_graph, 1)
    monkeypatch.setitem(sys.modules, "jax", types.ModuleType("jax"))
    in_process = _plan(gpt_graph, 2)
    assert in_process.estimates.stage_solves == alone.estimates.stage_solves
    assert in_process.estimates.step_time_s == alone.estimates.step_time_s
