"""Megatron's sequence parallelism on real gloo ranks (tests/seq_parallel_worker.py): a zoo
GPT and a zoo LLaMA with column / row-parallel styles pinned and ``sequence_parallel=True``
split every norm by sequence, gather before the column-parallel products and
reduce-scatter after the row-parallel ones, and train like one device. Megatron's
gathers a norm's output again in backward; planned without that rule (``gpt-kept``), the
forward views backward reads keep their gathered copies, and the step still trains like
one device."""

from __future__ import annotations

import pytest
import worker_io

SCENARIOS = [pytest.param("gpt:4"), pytest.param("llama:4", marks=pytest.mark.slow),
             pytest.param("gpt-kept:4", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=SCENARIOS)
def result(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("seq_parallel") / "seq_parallel.json"
    r = worker_io.launch_checked("seq_parallel_worker.py", out, request.param,
                                 nproc=4)[request.param]
    return request.param, r


def test_norms_split_by_sequence_and_train_like_one_device(result):
    name, r = result
    assert len(r["norms"]) == 5, r["norms"]        # 2 layers x 2 norms + the final one
    assert all(p == "(Shard(dim=1),)" for p in r["norms"].values()), r["norms"]
    assert {"all_gather", "reduce_scatter"} <= set(r["kinds"]), r["kinds"]
    for ours, ref in zip(r["losses"], r["ref_losses"], strict=True):
        assert ours == pytest.approx(ref, rel=1e-5)
    assert r["grad_rel_diff"] < 1e-4
    # after 3 Adam steps (lr 1e-3); GPT's key bias has a zero gradient in exact arithmetic
    # (softmax ignores a shift of every key score), float noise on both sides, which Adam
    # scales up to steps of lr: compared loosely
    for param, diff in r["param_diffs"].items():
        assert diff < (1e-2 if param.endswith("attn.c_attn.bias") else 1e-4), (param, diff)


def test_each_step_issues_the_planned_collectives(result):
    _, r = result
    for executed, planned in zip(r["executed"], r["planned_per_step"], strict=True):
        assert executed == planned


def test_megatron_gathers_again_where_the_free_plan_keeps_the_gathered_copy(result):
    # (LLaMA's norm output and its view follow one representative, where the rule does
    # not reach: its plan keeps gathered copies too, and they are priced)
    name, r = result
    if name == "gpt-kept:4":
        assert r["gathered_saved_views"] > 0      # the runtime path this scenario checks
    elif name == "gpt:4":
        assert r["gathered_saved_views"] == 0
