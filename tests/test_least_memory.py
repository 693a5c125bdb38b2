"""The least memory a view needs is said where someone reads it, and solved only there.

A view whose ILP has no plan within the budget names the least memory a plan of it needs:
up to 20 ILPs minimizing the peak (``intra_op._minimum_memory``), which near the budget
cost more than the ILP that failed. They are solved once, for the error a caller sees:
not for a simplified ILP whose failure only leads to the one with free followers, and not
inside AutoParallel's search (``least_memory_unsaid``), whose notes keep only that a
candidate does not fit.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from models import MLP

import torchalpa
from torchalpa.core.cluster import LogicalMesh
from torchalpa.frontends.torch_export import capture
from torchalpa.passes.sharding import intra_op
from torchalpa.passes.sharding.ilp import InfeasibleError, OverMemoryBudget
from torchalpa.passes.sharding.intra_op import least_memory_unsaid, plan_intra_op

MESH = LogicalMesh(shape=(4,), alpha=(1.0,), beta=(1.0,))


@pytest.fixture(scope="module")
def graph():
    with torch.device("meta"):
        model = MLP(32, 6)
        x, y = torch.empty(256, 32), torch.empty(256, 32)
    return capture(model, (x, y), F.mse_loss).graph


@pytest.fixture
def minimum_calls(monkeypatch):
    """The groupings ``_minimum_memory`` was solved on (their representative counts)."""
    calls: list[int] = []
    real = intra_op._minimum_memory

    def counted(graph, S, grouping, *args, **kwargs):
        calls.append(len(grouping.representatives))
        return real(graph, S, grouping, *args, **kwargs)

    monkeypatch.setattr(intra_op, "_minimum_memory", counted)
    return calls


def _tight(**option) -> torchalpa.ShardParallel:
    return torchalpa.ShardParallel(auto_sharding_option=torchalpa.AutoShardingOption(
        memory_budget_per_device=10_000, **option))


def test_the_error_says_the_least_memory_solved_once(graph, minimum_calls):
    with pytest.raises(InfeasibleError, match=r"it needs at least [\d.]+ KiB per device"):
        plan_intra_op(graph, MESH, _tight())
    assert len(minimum_calls) == 1


def test_unsaid_the_error_says_no_plan_fits_and_solves_no_least_memory(graph, minimum_calls):
    with least_memory_unsaid(), pytest.raises(InfeasibleError) as e:
        plan_intra_op(graph, MESH, _tight())
    assert minimum_calls == []
    assert "no plan of its ILP fits" in str(e.value) and "needs at least" not in str(e.value)
    # a message-only error (over the memory budget): a forked search worker sends it back
    # to the search, its type kept
    assert type(e.value) is OverMemoryBudget
    back = pickle.loads(pickle.dumps(e.value))
    assert type(back) is OverMemoryBudget and str(back) == str(e.value)
    # and said again once the block is left
    with pytest.raises(InfeasibleError, match="it needs at least"):
        plan_intra_op(graph, MESH, _tight())


def test_a_simplified_ilp_that_fails_leaves_the_least_memory_to_the_free_followers(
        graph, minimum_calls, monkeypatch):
    """Solved simplified first (``free_followers_below=0``), then with free followers, both
    over the budget: only the free followers' least memory is solved, the one the error
    names (before, the simplified one's was solved too and dropped)."""
    solved: list[int] = []
    real = intra_op._solve_within_memory

    def recording(graph, S, grouping, *args, **kwargs):
        solved.append(len(grouping.representatives))
        return real(graph, S, grouping, *args, **kwargs)

    monkeypatch.setattr(intra_op, "_solve_within_memory", recording)
    with pytest.raises(InfeasibleError, match="it needs at least"):
        plan_intra_op(graph, MESH, _tight(free_followers_below=0))
    assert len(solved) == 2 and solved[0] < solved[1], solved   # simplified, then free
    assert minimum_calls == [solved[1]]
