"""A job no plan fits is told what would fit by the views' memory floors
(``torchalpa/parallel/fit_advice.py``), in AutoParallel's ``NothingFitsError`` and in
ShardParallel's error alike.

The tiny GPT fully checkpointed, one micro-batch, on 2 devices at a budget between the
step's memory bound (386.8 KiB) and its views' floor (387.3 KiB): the bound alone advised
"at least 2 devices" -- the count just tried, which its floor refuses. Its floors refuse 3
devices too (the dims that split over 2 and 4 do not over 3) and let 4 through, where a
plan fits (its 1D view's, its peak 387.0 KiB, at the budget: the floor there, 194.1 KiB,
is far below it, which is why the advice says "at least")."""

from __future__ import annotations

import dataclasses
import re

import pytest
from search_models import meta_tiny_gpt

import torchalpa
import torchalpa.passes.sharding.intra_op as intra_op
from torchalpa.core.options import ShardParallel
from torchalpa.core.units import format_bytes
from torchalpa.frontends.block_remat import checkpointed_capture
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel import fit_advice as advice
from torchalpa.parallel import shard
from torchalpa.parallel.auto import NothingFitsError
from torchalpa.parallel.fit_advice import FitAdvice, least_floor, views_of
from torchalpa.passes.pricing.bounds import step_profile
from torchalpa.passes.sharding.ilp import InfeasibleError

DEVICES = re.compile(r"at least (\d+) devices of ([\d.]+ \w+)")
MEMORY = re.compile(r"(\d+) devices with at least ([\d.]+ \w+) each")


def _cluster(devices: int, memory: float) -> torchalpa.Cluster:
    return dataclasses.replace(torchalpa.Cluster.h100(1, devices), host_op_s=0.0,
                               memory_per_device=memory)


@pytest.fixture(scope="module")
def job():
    """(the fully checkpointed step, a budget between its bound and its floor on 2)."""
    model, batch, loss_fn = meta_tiny_gpt()
    graph = checkpointed_capture(capture(model, batch, loss_fn)).graph
    mesh = _cluster(2, 1.0).logical_mesh()
    need = step_profile(graph, mesh).memory_bytes(2)
    floor, _ = intra_op.memory_floor(graph, mesh, ShardParallel())
    assert need < floor, "the budget must pass the step's bound for these tests to test it"
    return graph, (need + floor) / 2


def _auto_error(budget: float) -> str:
    method = torchalpa.AutoParallel(remat=("full",), num_micro_batches=1, pipeline=False,
                                    offload=False, rematerialize_parameters=False)
    with pytest.raises(NothingFitsError) as error:
        torchalpa.plan(*meta_tiny_gpt(), cluster=_cluster(2, budget), method=method)
    return str(error.value)


def _shard_error(graph, budget: float) -> str:
    meshes = shard.candidate_meshes(_cluster(2, budget), ShardParallel())
    with pytest.raises(InfeasibleError) as error:
        shard.plan_graph(graph, method=ShardParallel(), meshes=meshes)
    return str(error.value)


def test_autoparallel_advises_a_count_that_fits_and_names_what_it_tried(job, ilp_calls):
    """The advice: more devices than tried, each count before it refused by every view's
    floor, the count's floor within the budget, and a plan found there; no ILP for it."""
    graph, budget = job
    text = _auto_error(budget)
    assert ilp_calls == []               # the candidate refused by its floor, the advice too
    assert "tried:\n  intra-op, remat=full: does not fit" in text
    (count, _), = DEVICES.findall(text)
    count = int(count)
    assert count > 2, f"advised {count} devices, tried 2:\n{text}"
    mesh = _cluster(2, budget).logical_mesh()
    tolerance = budget * (1 + intra_op.FIT_TOLERANCE)
    for n in range(3, count):
        assert least_floor(graph, views_of(mesh, n), ShardParallel())[0] > tolerance
    assert least_floor(graph, views_of(mesh, count), ShardParallel())[0] <= tolerance
    # a plan there: the 1D view's (4 devices: 23 CPU s, its peak at the budget; the 2x2
    # view's ILP ran past 300 s at load 12)
    plan = shard.plan_graph(graph, method=ShardParallel(),
                            meshes=[_cluster(count, budget).logical_mesh()])
    assert plan.estimates.memory_per_device_bytes <= tolerance


def test_autoparallel_and_shardparallel_give_the_same_advice(job):
    """The same job (one view of 2, full checkpointing, one micro-batch, parameters not
    gathered again) told by both methods: the same device count and memory; the memory
    is the views' floor, at or above which the budget must be."""
    graph, budget = job
    auto, sharded = _auto_error(budget), _shard_error(graph, budget)
    assert DEVICES.findall(auto) == DEVICES.findall(sharded) != []
    assert MEMORY.findall(auto) == MEMORY.findall(sharded) != []
    floor, _ = least_floor(graph, [_cluster(2, budget).logical_mesh()], ShardParallel())
    (_, memory), = MEMORY.findall(sharded)
    assert memory == torchalpa.core.units.format_bytes(floor)
    assert "1D mesh of 2 devices" in sharded       # what it tried


def test_the_advice_says_what_is_proved_and_what_is_a_bound():
    """Counts the step's bound refused, counts the floors refused, the count found (not a
    proof) and a scan that stopped before finding one."""
    found = FitAdvice(tried=2, budget=1024.0, memory=2048.0, first_checked=4, devices=6,
                      checked_to=6, devices_floor=900.0)
    assert found.devices_text() == (
        "at least 6 devices of 1.0 KiB (3 refused by the step's memory bound, 4-5 refused "
        "by every view's memory floor; on 6, their floor, 900 B, is within the budget: not "
        "a proof a plan fits)")
    stopped = FitAdvice(tried=2, budget=1024.0, memory=2048.0, first_checked=3,
                        devices=None, checked_to=9)
    assert stopped.devices_text().startswith(
        "more than 9 devices of 1.0 KiB (3-9 refused by every view's memory floor; larger "
        "counts not checked)")
    assert "at least 2.0 KiB each" in found.memory_text()
    unsplit = dataclasses.replace(found, unsplit=(5,))
    assert ("4-5 refused by every view (its memory floor; on 5, the batch or the method's pins do "
            "not split as asked)") in \
        unsplit.devices_text()


def test_counts_that_cannot_split_the_batch_are_refused_not_raised(job):
    """A view of 3 devices cannot split the batch of 8 where the method forces the batch
    over the mesh (data parallel): no floor, no error, inf."""
    graph, budget = job
    mesh = _cluster(2, budget).logical_mesh()
    forced = ShardParallel(auto_sharding_option=torchalpa.AutoShardingOption(
        force_batch_dim_to_mesh_dim=0))
    assert least_floor(graph, views_of(mesh, 3), forced)[0] == float("inf")
    assert least_floor(graph, views_of(mesh, 4), forced)[0] < float("inf")


def test_the_scan_stops_by_work_not_by_the_clock(job, monkeypatch):
    """The scan of device counts is bounded by graph nodes times views (``SCAN_WORK``),
    so the advice is the same at any load: with work for count 3's views alone it stops
    there, "more than 3" (3 is refused by every view's floor); with the default it reaches
    4, where a floor lets plans through."""
    graph, budget = job
    mesh = _cluster(2, budget).logical_mesh()
    found = advice.fit_advice(graph, [mesh], ShardParallel(), bound_devices=3)
    assert found is not None and found.devices == 4
    monkeypatch.setattr(advice, "SCAN_WORK", len(graph) * len(views_of(mesh, 3)))
    stopped = advice.fit_advice(graph, [mesh], ShardParallel(), bound_devices=3)
    assert stopped is not None and (stopped.devices, stopped.checked_to) == (None, 3)
    assert stopped.devices_text().startswith(f"more than 3 devices of {format_bytes(budget)}")
