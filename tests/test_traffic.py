"""Measured collective bytes in ``pm.last_step_stats()`` and ``pm.profile``'s labelled
timeline, on 2 real gloo ranks (tests/traffic_worker.py), against the plan's list."""

from __future__ import annotations

import pytest
import worker_io

from torchalpa.runtime.measurement.timeline import trace_path


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("traffic")
    return worker_io.launch("traffic_worker.py", tmp / "out.json", tmp, nproc=2)


@pytest.mark.parametrize("method", ["zero3", "data_parallel"])
def test_measured_bytes_per_kind_equal_the_plans_list(results, method):
    r = worker_io.scenario(results, method)
    assert r["planned"], "the plan issues collectives on 2 ranks"
    if method == "zero3":     # parameters gathered, gradients scattered
        assert {"all_gather", "reduce_scatter"} <= set(r["planned"])
    # steps 0 and 1 by train_step (the loss may ride a gradient bucket), step 2 by backward
    assert r["steps"][2]["planned"] == r["planned"]
    for step in r["steps"]:
        assert step["measured"] == step["planned"] == step["stats_planned"]
        # the wrappers saw what the dispatcher saw
        assert step["measured"] == step["dispatched"]
        assert step["sent"] == sum(b for _, b in step["planned"].values())
        assert step["count"] == sum(n for n, _ in step["planned"].values())
        assert "sent per rank:" in step["text"]
    # an all-gather gets back twice what it sends on 2 ranks, a reduce-scatter half
    if method == "zero3":
        sent = r["steps"][0]["measured"]
        expected = sum(b for k, (_, b) in sent.items()) + sent["all_gather"][1] \
            - sent["reduce_scatter"][1] // 2
        assert r["steps"][0]["received"] == expected


def test_profile_writes_a_trace_with_the_plans_collectives_labelled(results):
    r = worker_io.scenario(results, "profile")
    assert r["written"] == "trace.rank0.json"
    labels = r["labels"]
    assert "torchalpa::step 0" in labels and "torchalpa::step 1" in labels
    axis = r["axis_names"]
    for kind, a, nbytes in r["planned"]:
        where = f"axis {a} ({axis[a]})" if axis else f"axis {a}"
        assert f"torchalpa::{kind} {where} {nbytes} B" in labels, (kind, a, nbytes, labels)
        assert f"torchalpa::wait {kind}" in labels


def test_trace_paths_per_rank():
    assert trace_path("t.json", 0, 1) == "t.json"
    assert trace_path("out/t.json", 1, 4) == "out/t.rank1.json"
    assert trace_path("t{rank}.json", 3, 4) == "t3.json"
