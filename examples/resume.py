"""Training that survives a dead rank: torchrun restarts the job, which resumes from the
latest complete checkpoint.

    torchrun --nproc_per_node=4 --max-restarts=3 examples/resume.py --steps 200
    # kill any rank (kill -9 <pid>) while it trains: torchrun stops the others, starts
    # every rank again, and they continue from the last checkpoint, bit-identically

Every ``--every`` steps the script saves a checkpoint (a new version under ``--dir``;
a save interrupted by the kill is never loaded, the previous one is). At start it loads
the latest one, if any, with the random state, so dropout draws the same masks as an
uninterrupted run. The batch of step ``i`` comes from a generator seeded with ``i``:
any data pipeline that can seek to a step works the same way.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
from torchalpa.runtime.state.checkpoint import CheckpointError, checkpoint_extra, latest_checkpoint


def batch(step: int, size: int, dim: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(size, dim, generator=g), torch.randn(size, dim, generator=g)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dir", default="checkpoints/resume")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(4 * args.dim, args.dim))
    pm = torchalpa.auto_parallel(model, batch(0, args.batch, args.dim), F.mse_loss,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    start = 0
    try:
        latest_checkpoint(args.dir)
    except CheckpointError:
        pass                                          # nothing saved yet: a fresh start
    else:
        torchalpa.load_checkpoint(args.dir, pm)
        start = checkpoint_extra(args.dir)["step"]
    for step in range(start, args.steps):
        loss = pm.train_step(*batch(step, args.batch, args.dim))
        if (step + 1) % args.every == 0:
            version = torchalpa.save_checkpoint(args.dir, pm, extra={"step": step + 1})
            if dist.get_rank() == 0:
                print(f"step {step + 1}: loss {loss.item():.4f}, saved {version}", flush=True)
    torchalpa.shutdown()   # leaves the group and exits now (ending without it is clean too)


if __name__ == "__main__":
    main()
