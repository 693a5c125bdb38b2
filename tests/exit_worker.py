"""A finished training job that ends as ``argv[1]`` says (tests/test_shutdown.py, under
torchrun): ``shutdown`` (``torchalpa.shutdown()``), ``destroy``
(``dist.destroy_process_group()``), ``nothing``, or ``exit3`` (``sys.exit(3)``).

Every rank's heartbeat beats every millisecond here (``heartbeat.HEARTBEAT_S``), so a
store request is almost always in flight when the script ends: where a thread left
running into the interpreter's teardown aborts a finished process."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
from torchalpa.runtime.resilience import heartbeat

heartbeat.HEARTBEAT_S = 0.001


def main(ending: str) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    pm = torchalpa.auto_parallel(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)),
                                 (x, y), F.mse_loss,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    for _ in range(2):
        loss = pm.train_step(x, y)
    print(f"rank {dist.get_rank()} finished: loss {loss.item():.4f}", flush=True)
    if ending == "shutdown":
        torchalpa.shutdown()
    elif ending == "destroy":
        dist.destroy_process_group()
    elif ending == "exit3":
        sys.exit(3)


if __name__ == "__main__":
    main(sys.argv[1])
