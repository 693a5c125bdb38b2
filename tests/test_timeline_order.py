"""The order the step estimate assumes is the order the runtime issues: on 2 gloo ranks,
one ZeRO-3 step's recorded timeline (collective issues, waits, matmuls) equals
``assumed_program_order`` of its plan (tests/timeline_worker.py): each parameter's
all-gather issued one parameter ahead, right after the previous one's wait and before the
matmul that reads that one; with one micro-batch the gradients' reduce-scatters issued in
buckets during backward and waited for at its end."""

from __future__ import annotations

import pytest
import worker_io


@pytest.fixture(scope="module")
def timelines(tmp_path_factory):
    out = tmp_path_factory.mktemp("timeline") / "timeline.json"
    keys = ("zero3:1", "zero3:2", "zero3-bf16:1", "ddp:1")
    return worker_io.launch_checked("timeline_worker.py", out, ",".join(keys), nproc=2)


def test_one_micro_batch_step_runs_in_the_order_the_estimate_assumes(timelines):
    r = timelines["zero3:1"]
    assert r["same_graph"]
    assert r["recorded"] == [t for t in r["assumed"] if t != "backward"]
    order = r["recorded"]
    # prefetch: the second gather is issued before the first layer's matmul
    assert order[:4] == ["issue all_gather", "wait all_gather", "issue all_gather", "mm"]
    # a gradient bucket goes out while backward still has matmuls to run
    first_reduce = order.index("issue reduce_scatter")
    assert "mm" in order[first_reduce:]


def test_with_micro_batches_the_gradients_are_reduced_after_backward(timelines):
    """Two micro-batches: each one's forward and backward in the assumed order (the step
    runs both forwards, then both backwards), the gradients' reduce-scatters after the
    last backward (the estimate pays them in full, after it)."""
    r = timelines["zero3:2"]
    assert r["same_graph"]
    assumed = r["assumed"]
    assert not any("reduce_scatter" in t for t in assumed)
    split = assumed.index("backward")
    forward, backward = assumed[:split], assumed[split + 1:]
    recorded = r["recorded"]
    reduces = [i for i, t in enumerate(recorded) if "reduce_scatter" in t]
    assert reduces and min(reduces) > max(i for i, t in enumerate(recorded) if t == "mm")
    assert [t for t in recorded if "reduce_scatter" not in t] == 2 * forward + 2 * backward


def test_cast_gathers_are_prefetched_and_waited_after_the_next_compute(timelines):
    """Mixed precision: each parameter's bfloat16 copy is gathered (a cast gather). Its
    cast and gather are issued right after the previous gather's wait, so the matmul that
    reads the previous parameter runs before this gather is waited for; the estimate
    assumes the same order (it prices them as prefetched)."""
    r = timelines["zero3-bf16:1"]
    assert r["same_graph"]
    assert r["recorded"] == [t for t in r["assumed"] if t != "backward"]
    order = r["recorded"]
    assert order[:5] == ["issue all_gather", "wait all_gather", "issue all_gather", "mm",
                         "wait all_gather"]
    # every gather after the first of forward and of backward is issued before the matmul
    # that precedes its wait
    waits = [i for i, t in enumerate(order) if t == "wait all_gather"]
    issues = [i for i, t in enumerate(order) if t == "issue all_gather"]
    prefetched = [(i, w) for i, w in zip(issues, waits) if "mm" in order[i:w]]
    assert len(prefetched) == len(issues) - 2


def test_the_loops_loss_is_waited_for_after_backward(timelines):
    """``loss = pm(x, y); loss.backward()`` under a DDP plan: forward leaves the loss's
    all-reduce in flight and returns a PendingLoss; backward does not read it, so no rank
    waits for it before its backward's matmuls (the ranks meet once a step, at the
    gradient buckets, as DDP's do); it is waited for last, after the buckets."""
    r = timelines["ddp:1"]
    assert r["loss_type"] == "PendingLoss"
    order = r["order"]
    issue = order.index("issue loss")
    first_wait = order.index("wait all_reduce", issue)
    assert "mm" in order[issue:first_wait]              # backward ran before any wait
    assert "mm" not in order[first_wait:]
    assert order.count("wait all_reduce") == order.count("issue all_reduce") + 1
