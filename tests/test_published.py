"""benchmarks/published.py: every published configuration is well formed, its published
figure is turned into seconds with its source's own FLOP count, and a row builds and
plans with its layout pinned (shrunk, fast; the real smallest row is slow)."""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import replace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import published  # noqa: E402
from published_rows import (  # noqa: E402
    HELD_OUT,
    ROWS,
    TUNED,
    gpt_neox_flops,
    megatron_eq3_flops,
)

from torchalpa.core.options import ManualStageOption, PipeshardParallel  # noqa: E402


@pytest.mark.parametrize("row", ROWS, ids=[r.key for r in ROWS])
def test_every_row_pins_a_plan_for_its_published_machine(row):
    cluster = row.cluster()
    assert cluster.num_devices == row.tp * row.pp * row.dp
    assert sum(published.stage_blocks(row)) == row.config["num_layers"]
    method = published.method(row)
    if row.pp > 1:
        assert isinstance(method, PipeshardParallel)
        stages = method.stage_option
        assert isinstance(stages, ManualStageOption)
        per_stage = math.prod(stages.submesh_shapes[0])
        assert per_stage == row.dp * row.tp and len(stages.submesh_shapes) == row.pp
        micro = method.num_micro_batches
    else:
        micro = method.num_micro_batches
        assert math.prod(method.logical_mesh_shape) == row.dp * row.tp
    assert micro * row.micro_batch * row.dp == row.global_batch
    assert row.published_step_s() > 0


def test_published_rates_become_seconds_by_their_sources_flop_count():
    row = next(r for r in ROWS if r.key == "megatron21-1.7b")
    # 137 TFLOP/s per GPU on 32 GPUs under Eq. (3): 3.53 s per iteration
    assert row.published_step_s() == pytest.approx(3.53, abs=0.01)
    # BLOOM's log: 104.70 s per iteration, 149.77 TFLOP/s on 384 GPUs, Eq. (3) with V=250880
    assert megatron_eq3_flops(2048, 2048, 70, 14336, 250880) / 104.70 / 384 / 1e12 == \
        pytest.approx(149.77, rel=1e-3)
    tt = next(r for r in ROWS if r.key == "torchtitan-8b-h100x8")
    assert tt.published_step_s() == pytest.approx(2 * 8192 / 5762)


def test_a_pipelined_zero_row_builds_and_plans_with_its_layout_pinned():
    """Alpa's sanity case (pp2 x dp2 x op2, ZeRO over dp, recompute, fp16, p3.16xlarge)
    on a model small enough to plan in seconds."""
    alpa = next(r for r in ROWS if r.key == "alpa-2.6b")
    row = replace(alpa, config=dict(alpa.config, hidden=64, num_layers=4, num_heads=4,
                                    vocab_size=256, max_seq_len=32), seq=32, global_batch=16,
                  micro_batch=2)
    e = published.estimate(row)
    assert len(e.stage_s) == 2 and all(0 < s < math.inf for s in e.stage_s)
    assert 0 < e.step_s < math.inf and e.memory_bytes > 0


def test_a_plan_is_described_by_its_mesh_micro_batches_and_parameter_layouts():
    """What ``--auto --detail`` prints of AutoParallel's plan, read here off pinned plans
    whose shape is known: Alpa's pipeline (2 stages of 2 x 2 on 4 of a node's 8 GPUs, 4
    micro-batches, ZeRO over dp) and a tp2 row (one mesh of 2, parameters split or whole)."""
    alpa = next(r for r in ROWS if r.key == "alpa-2.6b")
    small = dict(hidden=64, num_layers=4, num_heads=4, vocab_size=256, max_seq_len=32)
    row = replace(alpa, config=dict(alpa.config, **small), seq=32, global_batch=16,
                  micro_batch=2)
    text = published.plan_layout(published.pinned_plan(row))
    assert text.startswith("pipeline of 2 stages ([1, 4]->[2, 2], [1, 4]->[2, 2]), "
                           "4 micro-batches, 1f1b; parameter layouts ")
    assert "S(0)" in text           # ZeRO: states split over dp
    meg = next(r for r in ROWS if r.key == "megatron20-v100-2b")
    row = replace(meg, config=dict(meg.config, **small), seq=32, global_batch=4,
                  micro_batch=4)
    text = published.plan_layout(published.pinned_plan(row))
    assert text.startswith("mesh [2], 1 micro-batch; parameter layouts ")
    counts = [int(n) for n in re.findall(r" x(\d+)", text)]
    assert sum(counts) == sum(1 for _ in published.build(row)[0].parameters())


@pytest.mark.slow
def test_the_smallest_published_row_is_estimated_within_20_percent():
    row = next(r for r in ROWS if r.key == "megatron20-v100-1b")
    ratio = published.estimate(row).step_s / row.published_step_s()
    assert 1 / 1.2 <= ratio <= 1 / 0.8


def test_a_row_on_an_unknown_machine_or_family_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^row x: unknown GPU or machine 'nope' .*choose from"):
        replace(ROWS[0], key="x", machine="nope")
    with pytest.raises(ValueError, match=r"^row x: the zoo has no family 'opt'; it has .*gpt"):
        replace(ROWS[0], key="x", family="opt")
    with pytest.raises(ValueError, match=r"^row x: remat='some'; one of none, selective, full"):
        replace(ROWS[0], key="x", remat="some")
    with pytest.raises(ValueError, match=r"^row x: flop_count='6nd'; one of megatron-eq3, "):
        replace(ROWS[0], key="x", flop_count="6nd")
    with pytest.raises(ValueError, match=r"^row x: the gpt-neox FLOP count needs flop_params"):
        replace(ROWS[0], key="x", flop_count="gpt-neox")


def _outcome(key: str, ratio: float, memory_ratio: float | None = None,
             memory_gib: float = 10.0, auto: float | None = None) -> published.Outcome:
    row = next(r for r in ROWS if r.key == key)
    row = replace(row, memory_gib=memory_gib if memory_ratio else None)
    step = ratio * row.published_step_s()
    memory = (memory_ratio or 1.0) * memory_gib * published.GIB
    e = published.Estimate(step_s=step, memory_bytes=memory, compute_s=None,
                           communication_s=None, hidden_s=None, stage_s=(), plan_seconds=0.0)
    return published.Outcome(row, e, auto)


def test_check_holds_the_table_to_its_targets():
    good = [_outcome("megatron21-1.7b", 1.02, 1.05, auto=1.0),
            _outcome("megatron20-v100-1b", 0.97), _outcome("alpa-2.6b", 1.01)]
    assert all(ok for _, ok in published.check(good))
    bad = [_outcome("megatron21-1.7b", 1.4, 0.8, auto=1e9),
           _outcome("megatron20-v100-1b", 1.2, memory_gib=40.0, memory_ratio=1.0),
           _outcome("alpa-2.6b", 1.1)]
    results = dict((text.split(" (")[0], ok) for text, ok in published.check(bad))
    assert not any(results.values()), results


def test_the_auto_target_counts_the_rows_at_or_below_the_published_plan():
    """``--auto``'s line: rows whose AutoParallel plan is at or below the published plan's
    estimate, of the rows it planned; the slower ones named with their ratio."""
    pinned = [_outcome(k, 1.0) for k in ("megatron21-1.7b", "alpa-2.6b", "megatron20-v100-1b")]
    assert published.auto_target(pinned) is None
    runs = [replace(pinned[0], auto_step_s=pinned[0].estimate.step_s * 0.9),
            replace(pinned[1], auto_step_s=pinned[1].estimate.step_s * 1.004), pinned[2]]
    text, ok = published.auto_target(runs) or ("", True)
    assert not ok and "in 1 of 2 rows run" in text and "alpa-2.6b 1.004x" in text
    assert published.check(runs)[-1] == (text, ok)
    runs[1] = replace(runs[1], auto_step_s=runs[1].estimate.step_s)
    text, ok = published.auto_target(runs) or ("", False)
    assert ok and "in 2 of 2 rows run" in text and "slower" not in text


def test_a_row_the_planner_refuses_fails_the_check(capsys):
    published._print_refused(["romero-gpt2-124m-4090x2"], 3, check=True)
    assert capsys.readouterr().out.startswith("FAIL  1 of 3 rows could not be estimated")
    published._print_refused([], 3, check=True)
    published._print_refused(["x"], 3, check=False)
    assert capsys.readouterr().out == ""


def _run(row) -> tuple:
    """What makes two rows the same run: model, sequence, batch, machine and plan."""
    return (row.family, tuple(sorted(row.config.items())), row.seq, row.global_batch,
            row.micro_batch, row.machine, row.num_nodes, row.tp, row.pp, row.dp, row.remat,
            row.zero, row.precision)


def test_held_out_rows_are_runs_the_tuned_table_does_not_hold():
    assert ROWS == TUNED + HELD_OUT and len(HELD_OUT) >= 6
    keys = [r.key for r in ROWS]
    assert len(set(keys)) == len(keys)
    tuned = {_run(r) for r in TUNED}
    assert not [r.key for r in HELD_OUT if _run(r) in tuned]
    # their published figures become seconds by their sources' rules: llm-foundry's
    # tokens/s per GPU over the global batch, a logged iteration time as it is
    mpt = next(r for r in HELD_OUT if r.key == "mpt-30b-h100x8")
    assert mpt.published_step_s() == pytest.approx(504 * 2048 / (8 * 2002))
    tr1 = next(r for r in HELD_OUT if r.key == "bigscience-tr1-13b-v100x256")
    assert tr1.cluster().devices_per_node == 4 and tr1.cluster().num_devices == 256
    assert tr1.published_step_s() == pytest.approx(22.3066)


def test_gpt_neox_rate_becomes_seconds_by_its_own_flop_count():
    """GPT-NeoX-20B's 117 TFLOP/s per GPU under the count its trainer logged (6 P + 60 s h l
    a token): 43.85 s a step on 96 GPUs, where Megatron's Eq. (3) would make it 47.66 s."""
    neox = next(r for r in HELD_OUT if r.key == "gpt-neox-20b-a100-40x96")
    per_token = 6 * 20_556_201_984 + 60 * 2048 * 6144 * 44
    assert gpt_neox_flops(1536, 2048, 44, 6144, 20_556_201_984) == 1536 * 2048 * per_token
    assert neox.published_step_s() == pytest.approx(43.846, abs=1e-3)
    assert megatron_eq3_flops(1536, 2048, 44, 6144, 50432) / 117e12 / 96 == \
        pytest.approx(47.659, abs=1e-3)
    assert "gpt-neox -> s/iter [D]" in neox.published_text()
    # four ConnectX-6 HCAs a server: half a DGX A100's network
    assert neox.cluster().inter_node_bandwidth < next(
        r for r in ROWS if r.machine == "dgx-a100").cluster().inter_node_bandwidth


def test_check_prints_the_held_out_rows_alone_when_both_sets_ran():
    tuned, held = _outcome("megatron21-1.7b", 1.0), _outcome(HELD_OUT[0].key, 1.5)
    assert published.held_out_outcomes([tuned, held]) == [held]
    assert published.held_out_outcomes([tuned]) == []


def test_rows_price_the_loss_their_source_ran():
    """llm-foundry's MPT rows and TinyLlama ran flash-attn's fused cross-entropy on bf16
    logits and llm.c's rows its fused classifier; every other source computes log-softmax
    and NLL (``published_rows``' docstring)."""
    from torchalpa.models.losses import fused_lm_loss, lm_loss
    for row in ROWS:
        # llm.c's fused_classifier, whoever ran it, keeps no float32 log-probabilities either
        fused = row.short_source in ("llm-foundry", "llm.c", "modded-nanogpt", "TinyLlama")
        assert published.workload(row).loss_fn is (fused_lm_loss if fused else lm_loss), row.key
        assert not (fused and row.float32_logits), row.key
