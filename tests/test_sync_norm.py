"""Synchronized batch norm on real gloo ranks (tests/sync_norm_worker.py): Alpa's conv net
planned with Alpa's unit costs splits its batch, each batch norm all-reduces its
per-channel sums, and training equals one device's (losses, gradients, parameters and
running statistics); every step issues exactly the plan's collectives. A wide net planned
model parallel reads one all-reduced convolution output in batch norm's forward and
backward: one all-reduce, shared (``Reshard.same_as``), and still one device's numbers."""

from __future__ import annotations

import pytest
import worker_io

SCENARIOS = [pytest.param("conv:4"), pytest.param("conv:2x2", marks=pytest.mark.slow)]
FAST = ("conv:4", "wide:4")      # run in one launch


@pytest.fixture(scope="module")
def fast_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync_norm") / "sync_norm.json"
    return worker_io.launch("sync_norm_worker.py", out, ",".join(FAST), nproc=4)


def _scenario(name, results):
    assert results["world_size"] == 4
    return name, worker_io.scenario(results, name)


@pytest.fixture(scope="module", params=SCENARIOS)
def result(request, tmp_path_factory):
    name = request.param
    if name in FAST:
        return _scenario(name, request.getfixturevalue("fast_results"))
    out = tmp_path_factory.mktemp("sync_norm") / "sync_norm.json"
    return _scenario(name, worker_io.launch("sync_norm_worker.py", out, name, nproc=4))


def test_batch_split_batch_norm_trains_like_one_device(result):
    _, r = result
    # every training batch norm, forward and backward, runs synchronized
    assert len(r["batch_synced"]) == 6, r["batch_synced"]
    for ours, ref in zip(r["losses"], r["ref_losses"]):
        assert ours == pytest.approx(ref, rel=1e-5)
    assert r["grad_rel_diff"] < 1e-4
    for key, diff in r["state_rel_diff"].items():     # weights and running statistics
        assert diff < 1e-4, (key, diff)


def test_batch_norm_statistics_all_reduces_are_the_planned_ones(result):
    name, r = result
    assert r["planned_per_step"][0] == r["planned"]       # loss.backward(); then train_step
    for executed, planned in zip(r["executed"], r["planned_per_step"], strict=True):
        assert executed == planned
    # per batch norm op (3 forward, 3 backward), one all-reduce of (2 sums x local
    # channels x 4 bytes) per mesh axis that splits the batch
    stats = [c for c in r["planned"] if c[0] == "all_reduce" and c[2] in (16, 32)]
    assert len(stats) in ((6,) if name == "conv:4" else (6, 12)), r["planned"]


def test_one_all_reduce_read_by_forward_and_backward(fast_results):
    """Model parallel: batch norm's forward and backward read the partial convolution
    output whole; one all-reduce serves both, planned and run."""
    _, r = _scenario("wide:4", fast_results)
    assert r["batch_synced"] == [] and r["shared_reads"] >= 1, r
    assert r["planned_per_step"][0] == r["planned"]       # loss.backward(); then train_step
    for executed, planned in zip(r["executed"], r["planned_per_step"], strict=True):
        assert executed == planned
    for ours, ref in zip(r["losses"], r["ref_losses"]):
        assert ours == pytest.approx(ref, rel=1e-5)
    assert r["grad_rel_diff"] < 1e-4
    for key, diff in r["state_rel_diff"].items():
        assert diff < 1e-4, (key, diff)
