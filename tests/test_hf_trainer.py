"""A torchalpa-parallelized HF model under ``transformers.Trainer`` (one process).

Trainer calls ``model(**batch)`` and reads ``outputs.loss``, which a ParallelModule
supports; it builds its own AdamW over ``model.parameters()`` (DTensors) and steps it.
The losses Trainer logs for the parallelized GPT-2 must equal those it logs for the same
GPT-2 on one device (same seed, same data order).

Trainer needs ``accelerate``, which is in the test extras (not a torchalpa dependency). Under
torchrun Trainer also wraps the model for data parallelism itself; that path is not
covered here -- with several ranks, a plain loop (``out = pm(**batch);
out.loss.backward(); opt.step()``) or ``pm.train_step(**batch)`` is the supported way.
"""

from __future__ import annotations

import pytest
import torch

import torchalpa

transformers = pytest.importorskip("transformers")
import accelerate  # noqa: E402,F401  (Trainer needs it; a missing one fails here, not skips)


pytestmark = pytest.mark.usefixtures("single_process_world")   # conftest.py


def trainer_losses(model, data, out_dir) -> list[float]:
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=4, per_device_train_batch_size=2, report_to=[],
        use_cpu=True, save_strategy="no", logging_steps=1, learning_rate=1e-2, seed=0,
        dataloader_drop_last=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_trains_a_parallelized_gpt2_like_the_plain_one(tmp_path):
    from torchalpa.models.hf import hf_config
    config = hf_config("gpt2")
    ids = torch.randint(config.vocab_size, (16, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids[i], "labels": ids[i]} for i in range(16)]
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config)
    # a ParallelModule computes the loss it captured (the model's mean) and so declares
    # accepts_loss_kwargs = False; the plain model gets the same convention here, or
    # Trainer would renormalize its loss by its own token count (num_items_in_batch)
    plain.accepts_loss_kwargs = False
    torch.manual_seed(0)
    pm = torchalpa.auto_parallel(transformers.GPT2LMHeadModel(config),
                                 {"input_ids": ids[:2], "labels": ids[:2]})
    want = trainer_losses(plain, data, tmp_path / "plain")
    got = trainer_losses(pm, data, tmp_path / "torchalpa")
    assert len(got) == len(want) == 4
    assert got == pytest.approx(want, rel=1e-4)
    assert got[-1] < got[0]
