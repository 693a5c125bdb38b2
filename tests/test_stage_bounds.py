"""The stage DP's rounds leave a stage variant unsolved where its LP bound is above the
stage's exact price found already (``StageSearch._cut_by_bounds``): the bound must be one
(no solve prices the stage below it), a variant cut must be one its solve prices no lower,
and a variant that could win must still be solved."""

from __future__ import annotations

import pytest
from search_models import (
    small_cluster,
    small_gpt_graph,
    small_pipeline,
    small_stage_search,
)

import torchalpa
from torchalpa.core.switches import PassSwitches
from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
from torchalpa.passes.pipeline_search.search_keys import Variant
from torchalpa.passes.pipeline_search.stage_search import StageSearch

NODE = (1, 4)
"""The submesh of one node of four devices: views (4,) and (2, 2)."""


@pytest.fixture(scope="module")
def gpt_graph():
    return small_gpt_graph()


def _one_node(memory_gb: float) -> torchalpa.Cluster:
    return small_cluster(memory_gb, nodes=1, devices=4)


def _search(graph, cluster: torchalpa.Cluster) -> StageSearch:
    return small_stage_search(graph, cluster)


@pytest.mark.parametrize("k, i, flight, recompute", [
    (0, 1, 1, False), (2, 3, 2, False), (0, 0, 1, True)])
def test_no_solve_prices_a_stage_below_its_bound(gpt_graph, k, i, flight, recompute):
    """On both views of a node: bound <= the exact price (both finite: all fit)."""
    exact = _search(gpt_graph, _one_node(10.0)).exact
    for view in exact.costs.layers.views(NODE):
        latency, _ = exact.exact(k, i, NODE, view, flight, recompute)
        bound = exact.lower_bound(k, i, NODE, view, flight, recompute)
        assert 0 < bound <= latency * (1 + 1e-9) and latency < float("inf"), view


def test_a_cut_view_could_not_have_beaten_the_stage(gpt_graph):
    """Layers 0-1 priced on (4,): the (2, 2) view the DP would ask for next is left
    unsolved, and solving it prices it above (4,); the other way round, (4,) is solved."""
    search = _search(gpt_graph, _one_node(10.0))
    exact, table = search.exact, search.table
    key = (0, 1, search.shapes.index(NODE), 1)
    best, _ = exact.exact(0, 1, NODE, (4,), 1)
    table.record(key, (4,), False, best, None)
    pick = (key, Variant((2, 2), False, False))
    solves = exact.exact_solves
    assert search._cut_by_bounds([pick]) == []
    assert exact.exact_solves == solves and search.num_cut == 1
    assert table.cut[key][(2, 2), False] > best
    assert table.cost(key) == best             # the stage's price is the solved view's
    solved, _ = exact.exact(0, 1, NODE, (2, 2), 1)
    assert solved >= table.cut[key][(2, 2), False] > best

    again = _search(gpt_graph, _one_node(10.0))
    again.table.record(key, (2, 2), False, solved, None)
    keep = (key, Variant((4,), False, False))
    assert again._cut_by_bounds([keep]) == [keep] and again.num_cut == 0


def test_a_uniform_partition_ranks_a_cut_view_by_its_bound(gpt_graph):
    """``view_best`` gives a cut variant its bound, not exact: the uniform partitions
    price it within their node budget where it may win."""
    search = _search(gpt_graph, _one_node(10.0))
    key = (0, 1, search.shapes.index(NODE), 1)
    search.table.record_cut(key, (2, 2), False, 1.0)
    latency, variant, is_exact = search.table.view_best(key, (2, 2))
    assert (latency, variant.view, is_exact) == (1.0, (2, 2), False)


def test_the_search_plans_the_same_with_its_bounds(gpt_graph):
    """The small pipeline's plan with and without the cuts: the same, but for the
    solves' clock readings."""
    plans = []
    for on in (True, False):
        with PassSwitches.using(stage_bounds=on):
            plans.append(plan_pipeline(gpt_graph, small_cluster(), small_pipeline(),
                                       workers=1).to_dict())
    assert _without_clocks(plans[0]) == _without_clocks(plans[1])


_CLOCKS = ("solve_seconds", "ilp_seconds", "total_seconds", "search_seconds")


def _without_clocks(found):
    if isinstance(found, dict):
        return {k: _without_clocks(v) for k, v in found.items() if k not in _CLOCKS}
    if isinstance(found, list):
        return [_without_clocks(v) for v in found]
    return found
