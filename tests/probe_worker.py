"""A worker with no model, for tests/test_worker_io.py: each rank all-reduces its rank and
reports its process id; ``fail_on=R`` makes rank R raise outside any scenario (a job that
does not finish). argv: output path, fail_on rank or -1."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from torchalpa.runtime.mesh import init_distributed  # noqa: E402
from worker_io import finish  # noqa: E402


def main():
    out_path, fail_on = sys.argv[1], int(sys.argv[2])
    init_distributed()
    if dist.get_rank() == fail_on:
        raise RuntimeError(f"probe failure on rank {fail_on}")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    finish({"world_size": dist.get_world_size(), "rank_sum": total.item(), "pids": pids},
           out_path)


if __name__ == "__main__":
    main()
