"""A worker with no model, for tests/test_worker_io.py: each rank all-reduces its rank and
reports its process id; ``fail_on=R`` makes rank R raise outside any scenario (a job that
does not finish), or, with ``where=scenario``, inside a scenario that the other ranks
finish only through a collective with R; ``fail_on=-2`` with ``where=scenario``: every rank
raises alike (the error is recorded, the job finishes). argv: output path, fail_on rank or
-1, where."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from worker_io import attempt, finish  # noqa: E402

from torchalpa.runtime.execution.mesh import init_distributed  # noqa: E402

SCENARIO_WAIT_S = 3.0     # the test waits for the job to stop: no need for the default


def rank_sum(fail_on: int) -> dict:
    """A scenario: rank ``fail_on`` raises before the all-reduce the others wait in."""
    if fail_on in (dist.get_rank(), -2):
        raise RuntimeError(f"probe failure in a scenario on rank {dist.get_rank()}")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return {"rank_sum": total.item()}


def main():
    out_path, fail_on = sys.argv[1], int(sys.argv[2])
    where = sys.argv[3] if len(sys.argv) > 3 else "outside"
    init_distributed()
    if where == "scenario":
        results = {name: attempt(lambda: rank_sum(fail_on), wait_s=SCENARIO_WAIT_S)
                   for name in ("first", "second")}
        finish(results, out_path)
        return
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
