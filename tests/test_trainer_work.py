"""benchmarks/trainer_work.py: the training metrics a published run's trainer updated on
every micro-batch are priced as their ops (a float32 cross-entropy over the logits each),
added to the row's estimate as their own term, and set on exactly the rows whose trainer
computed them."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import published  # noqa: E402
import trainer_work  # noqa: E402
from published_rows import ROWS  # noqa: E402

MPT_125M = next(r for r in ROWS if r.key == "mpt-125m-a100x8")


def _small(row):
    """``row`` shrunk to plan in seconds: 2 blocks of width 64, 512 tokens of vocabulary."""
    return replace(row, config=dict(row.config, hidden=64, num_layers=2, num_heads=4,
                                    vocab_size=512, max_seq_len=32), seq=32,
                   micro_batch=2, global_batch=2 * 2 * row.dp)


def test_a_row_with_trainer_metrics_costs_the_priced_ops_more_and_its_plan_no_more():
    with_metrics = _small(MPT_125M)
    without = replace(with_metrics, trainer_metrics=())
    a, b = published.estimate(with_metrics), published.estimate(without)
    priced = trainer_work.trainer_seconds(with_metrics)
    assert b.trainer_s == 0.0 and priced > 0.0
    assert a.trainer_s == pytest.approx(priced)
    assert a.step_s == pytest.approx(b.step_s + priced)
    assert a.plan_step_s == pytest.approx(b.step_s)     # the step itself is priced as before


def test_a_metric_costs_at_least_the_float32_bytes_it_moves_every_micro_batch():
    """The 125M row: per micro-batch and metric, 32 x 2048 tokens per GPU over a 50368
    vocabulary, cast from bf16 (2 bytes read, 4 written) and log-softmaxed in float32 (4
    read, 4 written): 14 bytes an entry at the A100's bandwidth at the least."""
    row = MPT_125M
    mesh = row.cluster().logical_mesh((row.dp,))
    entries = row.micro_batch * row.seq * row.config["vocab_size"]
    floor = entries * 14 / mesh.memory_bandwidth
    shape = (row.micro_batch * row.dp, row.seq, row.config["vocab_size"])
    one = trainer_work.metric_seconds_per_micro_batch("LanguageCrossEntropy", mesh, shape,
                                                      torch.bfloat16, row.dp)
    assert floor < one < 4 * floor
    micro_batches = row.global_batch // (row.micro_batch * row.dp)
    assert trainer_work.trainer_seconds(row) == pytest.approx(2 * micro_batches * one)
    # one metric fewer, half the work; a float32 head's logits are not cast again
    assert trainer_work.trainer_seconds(replace(row, trainer_metrics=row.trainer_metrics[:1])) \
        == pytest.approx(micro_batches * one)
    fp32 = trainer_work.metric_seconds_per_micro_batch("LanguageCrossEntropy", mesh, shape,
                                                       torch.float32, row.dp)
    assert fp32 < one


def test_an_unknown_trainer_metric_is_refused_in_one_line_naming_the_accepted():
    with pytest.raises(ValueError, match=r"^row x: trainer metric\(s\) 'Accuracy' unknown; "
                                         r"accepted: LanguageCrossEntropy, "
                                         r"LanguagePerplexity$"):
        replace(MPT_125M, key="x", trainer_metrics=("Accuracy",))
    meg = next(r for r in ROWS if r.tp > 1)
    with pytest.raises(ValueError, match=r"^row x: trainer metrics are priced on "
                                         r"data-parallel rows only"):
        replace(meg, key="x", trainer_metrics=("LanguageCrossEntropy",))


def test_exactly_the_rows_whose_trainer_updated_metrics_carry_them():
    """llm-foundry's runs went through Composer with ComposerMPTCausalLM's two training
    metrics on; every other source's loop computes the loss alone."""
    for row in ROWS:
        expected = ("LanguageCrossEntropy", "LanguagePerplexity") \
            if row.short_source == "llm-foundry" else ()
        assert row.trainer_metrics == expected, row.key


def test_detail_prints_the_trainer_metrics_as_their_own_term(capsys):
    e = published.Estimate(step_s=1.2, memory_bytes=1.0, compute_s=0.9,
                           communication_s=0.1, hidden_s=0.05, stage_s=(),
                           plan_seconds=0.0, trainer_s=0.2)
    published._print_row(published.Outcome(MPT_125M, e), detail=True)
    out = capsys.readouterr().out
    assert "+ trainer metrics 0.200s" in out and f"{1.2:>12.3f}" in out
    romero = next(r for r in ROWS if r.key == "romero-gpt2-124m-4090x2")
    published._print_row(published.Outcome(romero, replace(e, trainer_s=0.0)), detail=True)
    assert "trainer metrics" not in capsys.readouterr().out


def test_autoparallel_is_held_against_the_pinned_plan_without_the_trainer_term():
    e = published.Estimate(step_s=1.2, memory_bytes=1.0, compute_s=None,
                           communication_s=None, hidden_s=None, stage_s=(),
                           plan_seconds=0.0, trainer_s=0.2)
    at_plan = published.Outcome(MPT_125M, e, auto_step_s=1.0)
    text, ok = published.auto_target([at_plan]) or ("", False)
    assert ok, text
    text, ok = published.auto_target([replace(at_plan, auto_step_s=1.1)]) or ("", True)
    assert not ok and "1.100x" in text
