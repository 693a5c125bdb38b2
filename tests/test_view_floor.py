"""A whole graph's view whose memory floor is above its budget ends "does not fit" without
an ILP (``view_floor.floor_refusal``, called by ``shard.plan_graph``): every plan holds at
least the floor at some point, so where it refuses, the view's ILPs find nothing either,
and where a view's ILP fits, the floor is at or below its plan's peak.

The tiny GPT fully checkpointed on 2 devices: its floor (387.3 KiB) sits just above the
step's memory bound (386.8 KiB), so a budget between the two passes the bound
(``shard.memory_refusal``) and only the floor or the ILP can refuse it."""

from __future__ import annotations

import dataclasses

import pytest
from search_models import meta_tiny_gpt

import torchalpa
import torchalpa.passes.sharding.intra_op as intra_op
from torchalpa.core.options import ShardParallel
from torchalpa.core.switches import PassSwitches
from torchalpa.frontends.block_remat import checkpointed_capture
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel import shard
from torchalpa.parallel.auto import NothingFitsError
from torchalpa.passes.pricing.bounds import step_profile
from torchalpa.passes.sharding.ilp import InfeasibleError
from torchalpa.passes.sharding.view_floor import FloorRefusal, floor_refusal

FLOOR_WORDS = "its memory floor"


@pytest.fixture(scope="module")
def step():
    """(the fully checkpointed step, the step's memory bound on 2 devices, its floor)."""
    model, batch, loss_fn = meta_tiny_gpt()
    graph = checkpointed_capture(capture(model, batch, loss_fn)).graph
    cluster = _cluster(None)
    need = step_profile(graph, cluster).memory_bytes(2)
    floor, _ = intra_op.memory_floor(graph, _mesh(cluster), ShardParallel())
    assert need < floor, "the floor must sit above the bound for these tests to test it"
    return graph, need, floor


def _cluster(memory: float | None) -> torchalpa.Cluster:
    cluster = dataclasses.replace(torchalpa.Cluster.h100(1, 2), host_op_s=0.0)
    return cluster if memory is None else dataclasses.replace(cluster,
                                                               memory_per_device=memory)


def _mesh(cluster):
    (mesh,) = shard.candidate_meshes(cluster, ShardParallel())
    return mesh


def test_a_view_over_its_floor_is_refused_without_an_ilp(step, ilp_calls):
    """A budget between the bound and the floor: no ILP with the floor on, the same answer
    (does not fit) from the view's ILP with it off."""
    graph, need, floor = step
    cluster = _cluster((need + floor) / 2)
    with pytest.raises(InfeasibleError, match=FLOOR_WORDS):
        shard.plan_graph(graph, method=ShardParallel(), meshes=[_mesh(cluster)])
    assert ilp_calls == []
    with PassSwitches.using(view_floor=False), \
            pytest.raises(InfeasibleError) as by_ilp:
        shard.plan_graph(graph, method=ShardParallel(), meshes=[_mesh(cluster)])
    assert ilp_calls == [(2,)] and FLOOR_WORDS not in str(by_ilp.value)
    assert isinstance(floor_refusal(graph, _mesh(cluster), ShardParallel()), FloorRefusal)


@pytest.mark.parametrize("room", [pytest.param(1.02, marks=pytest.mark.slow), 3.0])
def test_a_view_the_ilp_fits_is_not_refused_and_plans_alike(step, ilp_calls, room):
    """``room`` times the floor: the view's ILP fits (2 % above it, at the budget; 3 times,
    memory binds nowhere), the floor lets it through and sits at or below the plan's
    peak; with room to spare (a quick ILP) the plan is also the one the floor off gives."""
    graph, _, floor = step
    mesh = _mesh(_cluster(floor * room))
    assert floor_refusal(graph, mesh, ShardParallel()) is None
    on = shard.plan_graph(graph, method=ShardParallel(), meshes=[mesh])
    peak = on.estimates.memory_per_device_bytes
    assert peak is not None and floor <= peak <= floor * room
    if room < 2:
        return
    with PassSwitches.using(view_floor=False):
        off = shard.plan_graph(graph, method=ShardParallel(), meshes=[mesh])
    assert ilp_calls == [(2,), (2,)]
    assert on.estimates.step_time_s == off.estimates.step_time_s
    assert [p.placements for p in on.parameters] == [p.placements for p in off.parameters]


def test_autoparallel_says_nothing_fits_without_an_ilp(step, ilp_calls):
    """AutoParallel held to full checkpointing at one micro-batch, on a budget between the
    bound and the floor: both candidates (parameters gathered again in backward or not)
    are answered "does not fit" by their floors, and the error lists them and what would
    fit, as their ILPs' answers do with the floor off."""
    _, need, floor = step
    method = torchalpa.AutoParallel(remat=("full",), num_micro_batches=1, pipeline=False,
                                    offload=False)

    def outcomes():
        model, batch, loss_fn = meta_tiny_gpt()
        with pytest.raises(NothingFitsError) as error:
            torchalpa.plan(model, batch, loss_fn, cluster=_cluster((need + floor) / 2),
                           method=method)
        return [(a.candidate.describe(), a.outcome) for a in error.value.attempts], \
            str(error.value)

    floored, text = outcomes()
    assert ilp_calls == []
    assert [o for _, o in floored] == ["does not fit", "does not fit"]
    assert text.count(FLOOR_WORDS) == 2 and "what would fit" in text
    with PassSwitches.using(view_floor=False):
        solved, text = outcomes()
    assert len(ilp_calls) == 2 and solved == floored and FLOOR_WORDS not in text
