"""Launched under torchrun by tests/test_hf_trainer.py: ``transformers.Trainer`` trains a
torchalpa-parallelized GPT-2, unchanged, on every rank.

Under torchrun Trainer (through Accelerate) hands each rank its own batches, so the model
is wrapped with ``inputs="local"``: rank r's ``per_device_train_batch_size`` rows are its
shard of the global batch. Rank 0 writes the losses Trainer logged, the plan's mesh and
whether any parameter stayed a plain tensor.

    trainer_worker.py OUT PER_DEVICE_BATCH
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from worker_io import attempt, finish  # noqa: E402

import torchalpa  # noqa: E402


def train(per_device: int) -> dict:
    import transformers
    from test_hf_trainer import no_dropout_gpt2_config, trainer_data, trainer_losses
    from torch.distributed.tensor import DTensor

    config = no_dropout_gpt2_config()
    ids, data = trainer_data(config)
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    example = ids[:per_device * world]                          # one global batch
    pm = torchalpa.auto_parallel(transformers.GPT2LMHeadModel(config),
                                 {"input_ids": example, "labels": example}, inputs="local",
                                 method=torchalpa.ShardParallel())
    out_dir = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"trainer-{os.getpid()}")
    losses = trainer_losses(pm, data, out_dir, per_device=per_device)
    return {"losses": losses, "mesh": list(pm.plan.mesh_shape), "world": dist.get_world_size(),
            "plain_parameters": [n for n, p in pm.named_parameters()
                                 if not isinstance(p, DTensor)]}


def main():
    out, per_device = sys.argv[1], int(sys.argv[2])
    finish({"trainer": attempt(lambda: train(per_device))}, out)


if __name__ == "__main__":
    main()
