"""The stage DP's exact solves are reused across micro-batches in flight only where that is
exact: a range's best plan with fewer micro-batches in flight answers a count it still
fits at, and anything else is solved."""

from __future__ import annotations

import pytest
from search_models import small_exact_stages, small_gpt_graph

from torchalpa.core.switches import PassSwitches
from torchalpa.passes.pipeline_search.layer_cache import SolveCache

GB = 1024 ** 3


@pytest.fixture(scope="module")
def gpt_graph():
    return small_gpt_graph()


def _costs(graph, memory_gb: float, cache=None):
    return small_exact_stages(graph, memory_gb, cache)


def _exact(costs, flight: int) -> tuple[float, object]:
    return costs.exact(0, 1, (1, 2), (2,), flight)


def test_a_plan_that_still_fits_answers_more_in_flight(gpt_graph):
    """Memory to spare: the one-in-flight plan answers eight in flight, without an ILP,
    with what an ILP solve at eight finds."""
    costs = _costs(gpt_graph, 10.0)
    one = _exact(costs, 1)
    solves = costs.exact_solves
    eight = _exact(costs, 8)
    assert costs.exact_solves == solves and costs.reused_in_flight == 1
    assert eight == one
    fresh = _costs(gpt_graph, 10.0)
    assert _exact(fresh, 8) == eight and fresh.reused_in_flight == 0


def test_a_plan_that_no_longer_fits_is_solved_again(gpt_graph):
    """A budget between one micro-batch's plan and eight of them: eight in flight is
    solved by its own ILP, slower than or as fast as one, never answered by it. (Here no
    plan fits eight, and the stage's memory floor proves so before any ILP,
    ``tests/test_stage_floor.py``: off for the ILP's path, and on it gives the same.)"""
    with PassSwitches.using(stage_floor=False):
        eight, one = _eight_after_one(gpt_graph, solved=True)
    assert eight[0] >= one[0]
    floored, _ = _eight_after_one(gpt_graph, solved=False)
    assert floored == eight


def _eight_after_one(gpt_graph, *, solved: bool):
    """The stage at eight in flight, asked after one and four on a budget where the
    one-in-flight plan fits four, not eight; ``solved``: whether an ILP answers eight."""
    cache = SolveCache()
    probe = _costs(gpt_graph, 10.0, cache)
    _exact(probe, 1)
    (_, lean, memory), = [cache.peek(key) for key in list(cache._items)
                          if key[0] == "stage"]
    assert not lean
    state, peak, saved = memory
    # room for the fastest plan with four in flight, not with eight
    budget = state + peak + 5 * saved
    costs = _costs(gpt_graph, budget / GB)
    assert costs._fits(memory, 0, 1, 4, False) and not costs._fits(memory, 0, 1, 8, False)
    one = _exact(costs, 1)
    four = _exact(costs, 4)
    assert costs.reused_in_flight == 1 and four == one
    solves = costs.exact_solves
    eight = _exact(costs, 8)
    assert (costs.exact_solves > solves) == solved and costs.reused_in_flight == 1
    return eight, one


def test_a_solved_plan_fits_where_it_was_solved(gpt_graph):
    """The memory the reuse checks is the memory the ILP constrained: every plan the
    search solves fits, by ``_fits``, with the micro-batches it was solved for."""
    cache = SolveCache()
    costs = _costs(gpt_graph, 0.05, cache)
    for flight in (1, 3, 8):
        costs.exact(0, 1, (1, 2), (2,), flight)
        costs.exact(1, 2, (1, 2), (2,), flight, recompute=True)
    solved = [(key, cache.peek(key)) for key in list(cache._items) if key[0] == "stage"]
    assert solved
    for key, (seconds, _, memory) in solved:
        if seconds is not None:
            recompute = any(isinstance(part, tuple) and part[0] == "recompute" for part in key)
            k, i = (1, 2) if recompute else (0, 1)
            assert costs._fits(memory, k, i, key[6], recompute), key
