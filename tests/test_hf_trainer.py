"""A torchalpa-parallelized HF model under ``transformers.Trainer``, in one process and
under torchrun on 2 gloo ranks.

Trainer calls ``model(**batch)`` and reads ``outputs.loss``, which a ParallelModule
supports; it builds its own AdamW over ``model.parameters()`` (DTensors) and steps it.
The losses Trainer logs for the parallelized GPT-2 must equal those it logs for the same
GPT-2 on one device (same seed, same data order).

Under torchrun, Accelerate would wrap a model in DDP; a ParallelModule tells Trainer it owns
its placement and gradient reduction (``is_distributed_loading_by_transformers``), so
Trainer leaves it unwrapped, and Accelerate gives each rank every other batch of the
sampler's order: with ``inputs="local"``, two ranks of 2 rows train on the global batch
of 4 that one device with batches of 4 sees.

Trainer needs ``accelerate``, which is in the test extras (not a torchalpa dependency).
"""

from __future__ import annotations

import pytest
import torch
from worker_io import launch

import torchalpa

transformers = pytest.importorskip("transformers")
import accelerate  # noqa: E402,F401  (Trainer needs it; a missing one fails here, not skips)


def trainer_losses(model, data, out_dir, *, per_device: int = 2) -> list[float]:
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=4, per_device_train_batch_size=per_device, report_to=[],
        use_cpu=True, save_strategy="no", logging_steps=1, learning_rate=1e-2, seed=0,
        dataloader_drop_last=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def trainer_data(config):
    """16 rows of 8 token ids (the same on every rank), as Trainer's dataset."""
    ids = torch.randint(config.vocab_size, (16, 8), generator=torch.Generator().manual_seed(0))
    return ids, [{"input_ids": ids[i], "labels": ids[i]} for i in range(16)]


def no_dropout_gpt2_config():
    """GPT-2's tiny config without dropout: two ranks draw a sharded dropout mask in blocks
    (same rate, other numbers than one device), so only a run without it can match exactly."""
    from torchalpa.models.hf import hf_config
    return hf_config("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def plain_gpt2(config):
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config)
    # a ParallelModule computes the loss it captured (the model's mean) and so declares
    # accepts_loss_kwargs = False; the plain model gets the same convention here, or
    # Trainer would renormalize its loss by its own token count (num_items_in_batch)
    plain.accepts_loss_kwargs = False
    return plain


@pytest.mark.usefixtures("single_process_world")   # conftest.py
def test_trainer_trains_a_parallelized_gpt2_like_the_plain_one(tmp_path):
    from torchalpa.models.hf import hf_config
    config = hf_config("gpt2")
    ids, data = trainer_data(config)
    plain = plain_gpt2(config)
    torch.manual_seed(0)
    pm = torchalpa.auto_parallel(transformers.GPT2LMHeadModel(config),
                                 {"input_ids": ids[:2], "labels": ids[:2]},
                                 method=torchalpa.ShardParallel())
    want = trainer_losses(plain, data, tmp_path / "plain")
    got = trainer_losses(pm, data, tmp_path / "torchalpa")
    assert len(got) == len(want) == 4
    assert got == pytest.approx(want, rel=1e-4)
    assert got[-1] < got[0]


@pytest.mark.slow         # a fresh torchrun of 2 ranks importing transformers: minutes on 2 cores
@pytest.mark.usefixtures("single_process_world")
def test_trainer_under_torchrun_on_two_ranks_matches_one_device(tmp_path):
    config = no_dropout_gpt2_config()
    _, data = trainer_data(config)
    want = trainer_losses(plain_gpt2(config), data, tmp_path / "plain", per_device=4)
    result = launch("trainer_worker.py", tmp_path / "out.json", 2, nproc=2, real=True,
                    timeout=900)["trainer"]
    assert "error" not in result, result.get("trace")
    assert result["world"] == 2 and result["mesh"] == [2]
    assert result["plain_parameters"] == []          # every parameter a DTensor: not DDP
    assert len(result["losses"]) == 4
    assert result["losses"] == pytest.approx(want, rel=1e-4)
