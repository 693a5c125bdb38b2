"""The stage search's own work, apart from its ILPs: the DP builds only the (first layer,
last layer) blocks that can end in a pipeline, and each stage's additive candidates are
priced once however many rounds and settings read them."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from search_models import (
    small_cluster,
    small_gpt_graph,
    small_stage_search,
)
from test_stages import random_costs

from torchalpa.passes.pipeline_search.stage_search import StageSearch
from torchalpa.passes.pipeline_search.stages import brute_force, stage_dp, submesh_shapes


def _blocks_that_can_end(L: int, S: int) -> int:
    """(k, i) blocks a DP over ``L`` layers and up to ``S`` stages needs: with s stages
    from layer k on, k <= L - s and k <= i <= L - s."""
    return sum((L - s - k + 1) for s in range(1, S + 1) for k in range(L - s + 1))


@pytest.mark.parametrize("layers,nodes,devices,micro", [(8, 2, 4, 16), (6, 1, 8, 64)])
def test_dp_compares_only_blocks_that_can_end(layers, nodes, devices, micro):
    """Per bound run, at most (blocks that can end) x submeshes x device counts candidates
    (the full array: layers^2 x stages blocks, three to five times as many here), and the
    brute force's answer."""
    shapes = submesh_shapes(nodes, devices)
    cost = random_costs(layers, shapes, seed=1)
    got = stage_dp(layers, nodes, devices, micro, cost)
    assert got.total == pytest.approx(brute_force(layers, nodes, devices, micro, cost))
    D, J, S = nodes * devices, len(shapes), min(layers, nodes * devices)
    per_run = _blocks_that_can_end(layers, S) * J * (D + 1)
    assert 0 < got.num_candidates <= got.num_t_max_tried * per_run
    assert per_run * 3 <= layers * layers * S * J * (D + 1)


@pytest.fixture(scope="module")
def gpt_graph():
    return small_gpt_graph()


def _search(graph) -> StageSearch:
    """The small GPT's stage search on one node of four devices, one worker."""
    return small_stage_search(graph, small_cluster(10.0, nodes=1, devices=4))


def test_each_stage_candidates_priced_once(gpt_graph):
    """A whole search on the small GPT (rounds, the uniform partitions, the last DP
    without guesses where rounds run out): ``StageCosts.candidates`` once per stage."""
    search = _search(gpt_graph)
    asked: Counter = Counter()
    candidates = search.costs.candidates

    def counted(k, i, submesh, flight):
        asked[k, i, submesh, flight] += 1
        return candidates(k, i, submesh, flight)
    search.costs.candidates = counted       # type: ignore[method-assign]
    search._dp(guess=False)           # the rounds' last DP, as when they run out
    result = search.run()
    assert math.isfinite(result.solution.total) and asked
    assert max(asked.values()) == 1, asked.most_common(3)


def test_a_round_reprices_only_the_stages_it_priced(gpt_graph):
    """After a stage is priced, the next DP works out the cheapest variant of that stage
    alone again, and answers as a table that never kept any."""
    search = _search(gpt_graph)
    first = search._dp()
    key = search._keys(first)[0]
    picked, _ = search.table.picked(key)
    view, _, recompute = picked
    worked: Counter = Counter()
    cheapest = search.table._cheapest

    def counted(key, guess):
        worked[key, guess] += 1
        return cheapest(key, guess)
    search.table._cheapest = counted         # type: ignore[method-assign]
    search.table.record(key, view, recompute, first.stages[0].latency * 3, None)
    again = search._dp()
    assert list(worked) == [(key, True)] and worked[key, True] == 1

    fresh = _search(gpt_graph)
    fresh.table.record(key, view, recompute, first.stages[0].latency * 3, None)
    assert fresh._dp() == again
