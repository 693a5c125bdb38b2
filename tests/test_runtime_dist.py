"""The runtime's training-loop features on real gloo ranks (tests/runtime_worker.py):
gradient accumulation, mixed precision, inference, clip_grad_norm_ / optimizers / LR
schedulers, meta-device models, checkpoints across meshes and world sizes, and failures
that reach every rank. Each launch runs several scenarios, on the session's rank pools
(tests/worker_io.py); the failures run as plain processes of their own (a rank dies).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import worker_io

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "runtime_worker.py")
SCENARIOS_4 = ("micro_dp,micro_default,micro_zero2,mixed_precision,inference,conventions,meta_init,"
               "checkpoint,checkpoint_strided,checkpoint_strided_as_on_2_11,input_mismatch,export")
SCENARIOS_2 = "checkpoint_other_world,micro_default,conventions,input_mismatch,input_values"


def launch(nproc: int, scenarios: str, shared, tmp_path) -> dict:
    results = worker_io.launch("runtime_worker.py", tmp_path / f"runtime_{nproc}.json",
                               scenarios, shared, nproc=nproc)
    assert results["world_size"] == nproc
    return results


get = worker_io.scenario       # results[name], or the test fails with the scenario's trace


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def four(shared, tmp_path_factory):
    return launch(4, SCENARIOS_4, shared, tmp_path_factory.mktemp("four"))


@pytest.fixture(scope="module")
def two(four, shared, tmp_path_factory):   # after `four`: it loads four's checkpoint
    return launch(2, SCENARIOS_2, shared, tmp_path_factory.mktemp("two"))


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# -- gradient accumulation ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["micro_dp", "micro_default"])
def test_micro_batches_match_the_whole_batch(four, name):
    r = get(four, name)
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert rel(got, want) < 1e-5       # mean of micro-batch means: summation order only
    assert r["grad_rel_diff"] < 1e-5       # loss.backward() over all micro-batches
    assert r["param_rel_diff"] < 1e-4      # after 3 Adam steps (lr 1e-3)


@pytest.mark.parametrize("name", ["micro_dp", "micro_default"])
def test_micro_batches_issue_the_planned_collectives_per_micro_batch(four, name):
    r = get(four, name)
    k = 4 if name == "micro_dp" else 2
    assert r["input_shape"][0] * k == 64   # planned for one micro-batch
    # each micro-batch returns its loss: its all-reduce runs k times; the gradients'
    # final reductions once (the plan is priced so: ShardParallel.num_micro_batches)
    for c in r["planned_once"]:
        if c[0] == "all_reduce" and c[2] == 4:     # the loss (absent if not batch-split)
            assert r["expected"].count(c) == k * r["planned_once"].count(c)
    if name == "micro_dp":           # data parallel: a gradient bucket, once per step
        assert len(r["expected"]) < k * len(r["planned_once"])
    for executed in r["executed"]:          # both loss.backward() and train_step
        assert executed == r["expected"]
    # buckets merge the gradients' final collectives: the same bytes in fewer collectives
    assert sum(c[2] for c in r["expected"]) == sum(c[2] for c in r["per_gradient"])
    merged = sum(n - 1 for n in r["bucket_sizes"])
    assert len(r["expected"]) == len(r["per_gradient"]) - merged


def test_zero2_micro_batches_gather_the_parameters_once_per_step(four):
    """ZeRO-2 with 2 micro-batches: the parameters forward reads are gathered once per
    step, in one bucket, before the first micro-batch (runtime/rewrites/param_gather.py), and the
    step still equals one device's, by loss.backward() and by train_step."""
    r = get(four, "micro_zero2")
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert rel(got, want) < 1e-5
    assert r["grad_rel_diff"] < 1e-5 and r["param_rel_diff"] < 1e-4
    for executed in r["executed"]:
        assert executed == r["expected"]
    gathers = [c for c in r["expected"] if c[0] == "all_gather"]
    one_micro_batch = [c for c in r["planned_once"] if c[0] == "all_gather"]
    assert len(one_micro_batch) >= 6         # each of the MLP's 6 parameters on its own
    assert len(gathers) == 1                 # all of them, once, for both micro-batches
    assert gathers[0][2] == sum(c[2] for c in one_micro_batch)


def test_micro_batches_on_two_ranks(two):
    r = get(two, "micro_default")
    assert all(rel(a, b) < 1e-5 for a, b in zip(r["losses"], r["ref_losses"]))
    assert all(e == r["expected"] for e in r["executed"])


# -- mixed precision ----------------------------------------------------------------------

def test_mixed_precision_keeps_float32_masters_and_gradients(four):
    for r in get(four, "mixed_precision").values():
        assert r["param_dtypes"] == ["torch.float32"]
        assert r["grad_dtypes"] == ["torch.float32"]
        assert r["bf16_in_program"]


def test_mixed_precision_data_parallel_equals_the_bf16_step_on_one_device(four):
    r = get(four, "mixed_precision")["dp"]
    # Same parameters, same bf16 ops per row: the first loss matches the single-device
    # bf16 step to float32 rounding, while bf16 moves it 30x further from float32.
    assert rel(r["losses"][0], r["bf16_losses"][0]) < 1e-6
    assert rel(r["bf16_losses"][0], r["fp32_losses"][0]) > 1e-5
    # Later steps: gradients summed across ranks round differently in bf16; Adam turns
    # that into bf16-level parameter differences.
    for got, want in zip(r["losses"], r["bf16_losses"]):
        assert rel(got, want) < 1e-4


def test_mixed_precision_stays_within_bf16_tolerance_of_float32(four):
    for r in get(four, "mixed_precision").values():
        for got, want in zip(r["losses"], r["fp32_losses"]):
            assert rel(got, want) < 1e-3           # bf16 has 8 bits of mantissa
        assert r["param_rel_diff_fp32"] < 0.2        # Adam on bf16 gradients, 3 steps


# -- inference ----------------------------------------------------------------------------

def test_eval_mode_loss_and_predict_match_single_device(four):
    r = get(four, "inference")
    assert r["eval_predict_diff"] < 1e-5
    assert rel(r["eval_loss"], r["ref_eval_loss"]) < 1e-6
    assert r["eval_loss_requires_grad"] is False


def test_no_grad_runs_forward_only(four):
    r = get(four, "inference")
    assert r["no_grad_loss_requires_grad"] is False
    assert r["grads_after_no_grad"] == [False] * 4


def test_predict_follows_the_model_mode(four):
    assert get(four, "inference")["train_predict_differs"] > 0.1   # dropout(0.5) is on


def test_predict_after_training_in_the_training_layouts(four):
    r = get(four, "inference")
    assert r["trained_predict_diff"] < 1e-5 * max(1.0, r["trained_predict_scale"])
    assert len({tuple(p) for p in r["placements"].values()}) > 1   # not all alike
    assert r["loss_after_predict"] > 0                              # training goes on


def test_predict_returns_the_model_output_structure(four):
    r = get(four, "inference")
    assert r["dict_keys"] == ["a", "b"] and r["dict_diff"] < 1e-5


# -- training-loop conventions ------------------------------------------------------------

@pytest.mark.parametrize("world", ["four", "two"])
def test_clip_grad_norm_sgd_momentum_and_lr_scheduler(world, request):
    r = get(request.getfixturevalue(world), "conventions")
    assert len(r["placements"]) > 1                 # sharded and replicated parameters
    for got, want in zip(r["norms"], r["ref_norms"]):
        assert rel(got, want) < 1e-5
    assert all(n > 0.05 for n in r["ref_norms"])    # so the clipping did act
    assert r["clipped_grad_rel_diff"] < 1e-5
    assert r["lrs"] == [0.05, 0.025, 0.0125]
    assert all(rel(a, b) < 1e-5 for a, b in zip(r["losses"], r["ref_losses"]))
    assert r["sgd_param_rel_diff"] < 1e-5
    assert r["momentum_is_dtensor"]


def test_adamw(four):
    r = get(four, "conventions")
    assert all(rel(a, b) < 1e-5 for a, b in zip(r["adamw_losses"], r["adamw_ref_losses"]))
    assert r["adamw_param_rel_diff"] < 1e-4


# -- large models -------------------------------------------------------------------------

def test_unwrap_and_save_pretrained_gather_the_trained_shards(four):
    r = get(four, "export")
    assert r["sharded"] > 0 and not r["plain_is_dtensor"]
    assert r["unwrap_rel_diff"] < 1e-5 and r["saved_rel_diff"] < 1e-5
    assert r["stats"]["step_time_s"] > 0
    assert r["stats"]["includes"] == "forward+backward+optimizer"
    assert r["stats"]["planned_collectives"] == r["stats"]["num_collectives"]


def test_meta_model_holds_only_local_blocks(four):
    r = get(four, "meta_init")
    for name, p in r["params"].items():
        assert p["sharded"], name                      # parameters="sharded" on 4 ranks
        numel = lambda s: eval("*".join(map(str, s)) or "1")  # noqa: E731
        assert numel(p["local"]) * 4 == numel(p["global"]), name
        assert p["storage_numel"] == numel(p["local"]), name   # no hidden whole tensor
    assert r["state_full_numels"] == [False]           # grads and Adam states too


def test_meta_model_is_initialized_with_distinct_blocks_and_trains(four):
    r = get(four, "meta_init")
    for name, p in r["params"].items():
        assert not p["blocks_equal"], name             # each block drew its own numbers
        assert p["std"] > 0.01, name                   # reset_parameters() ran
    assert r["losses"][-1] < r["losses"][0] * 0.95


# -- checkpoints --------------------------------------------------------------------------

def test_checkpoint_resumes_bit_identically(four):
    r = get(four, "checkpoint")
    assert r["resumed"] == r["uninterrupted"][2:]


def test_checkpoint_loads_into_another_mesh_and_plan(four):
    r = get(four, "checkpoint")
    assert any(len(p) == 2 for p in r["placements_2x2"].values())
    # S(0) on 4 ranks and S(0)S(0) on 2x2 hold the same blocks: identical arithmetic
    assert r["resumed_2x2"] == r["uninterrupted"][2:]
    # every parameter replicated instead: the same values, other summation order
    assert r["placements_dp"] != r["placements_1d"]
    assert all(rel(a, b) < 1e-5 for a, b in zip(r["resumed_dp"], r["uninterrupted"][2:]))


def test_checkpoint_of_a_fused_qkv_split_by_heads(four):
    """DCP cannot describe a strided shard's block (one offset and size): the checkpoint
    holds such a parameter (and its Adam moments) as plain shards, and loads back into the
    strided layout bit-identically, and into data parallelism and back to the same values."""
    r = get(four, "checkpoint_strided")
    assert r["placements"]["c_attn.weight"] == ["_S(0, 3)"]
    assert r["resumed"] == r["uninterrupted"][2:]
    assert rel(r["resumed_dp"][0], r["uninterrupted"][2]) < 1e-5
    assert rel(r["resumed_back"][0], r["uninterrupted"][3]) < 1e-5


def test_strided_shards_checkpoint_where_dtensor_cannot_redistribute_them(four):
    """As on PyTorch 2.11, whose DTensor raised on a lone strided shard: the runtime
    gathers it itself, and the checkpoint and the gathered values are the same."""
    r, want = get(four, "checkpoint_strided_as_on_2_11"), get(four, "checkpoint_strided")
    assert r["refused"] > 0, "DTensor was never asked: the simulation shows nothing"
    for key in ("placements", "gathered", "uninterrupted", "resumed", "resumed_dp",
                "resumed_back"):
        assert r[key] == want[key], key


def test_checkpoint_loads_into_fewer_ranks(four, two):
    r = get(two, "checkpoint_other_world")
    assert r["mesh"] == [2]
    want = get(four, "checkpoint")["uninterrupted"][2:]
    assert all(rel(a, b) < 1e-5 for a, b in zip(r["resumed"], want))


# -- faults -------------------------------------------------------------------------------

@pytest.mark.parametrize("world", ["four", "two"])
def test_different_input_shapes_across_ranks_are_named_on_every_rank(world, request):
    message = get(request.getfixturevalue(world), "input_mismatch")["raised"]
    assert message and re.search(r"rank\(s\) 1: \[\(4, 16\)", message)
    assert "(8, 16)" in message


def test_ranks_given_different_values_are_named(two):
    r = get(two, "input_values")
    # "first": the first call (rank 1's batch differs) raises; the second is not checked
    assert r["first"][0] and "rank(s) 1 passed a different batch" in r["first"][0]
    assert r["first"][1] is None
    assert all(m and "rank(s) 1 passed a different batch" in m for m in r["always"])
    assert r["never"] == [None, None]


@pytest.fixture(scope="module")
def faults():
    """Two 2-rank jobs at once, launched as plain processes (no torchrun agent to kill the
    survivors): rank 1 raises, or hangs, after its first step. Rank 0's outcome per kind."""
    timeout_s = 10
    jobs = {}
    for kind in ("raise", "hang"):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(worker_io.free_port()),
                   WORLD_SIZE="2", OMP_NUM_THREADS="1", TORCHALPA_TIMEOUT_S=str(timeout_s))
        procs = [subprocess.Popen([sys.executable, WORKER, "--fault", kind],
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in (0, 1)]
        jobs[kind] = (procs, time.monotonic())
    results = {}
    for kind, (procs, _start) in jobs.items():
        try:
            out, err = procs[0].communicate(timeout=120)
        except subprocess.TimeoutExpired:
            procs[0].kill()
            out, err = procs[0].communicate()
        procs[1].kill()
        procs[1].communicate()
        step = re.search(r"second step ended after ([\d.]+) s", out)
        results[kind] = {"returncode": procs[0].returncode, "stderr": err,
                         "seconds": float(step.group(1)) if step else None,
                         "timeout_s": timeout_s}
    return results


def test_a_rank_that_raises_is_named_on_the_others(faults):
    r = faults["raise"]
    assert r["returncode"] != 0
    assert "RankFailedError" in r["stderr"]
    assert "rank 1 failed with ValueError: injected failure on rank 1" in r["stderr"]
    assert r["seconds"] is not None and r["seconds"] < r["timeout_s"]   # no waiting


def test_a_rank_that_hangs_is_named_after_the_timeout(faults):
    r = faults["hang"]
    assert r["returncode"] != 0
    assert "rank(s) 1 did not respond" in r["stderr"] and "TORCHALPA_TIMEOUT_S" in r["stderr"]
    # the collective timeout, then a short roll call among the ranks still alive
    assert r["timeout_s"] <= r["seconds"] < r["timeout_s"] + 10
