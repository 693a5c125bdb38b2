"""Whether a pending point-to-point send keeps its tensor alive until waited for (gloo).

    cd benchmarks && python send_work_holds.py

Two gloo ranks: rank 0 ``isend``s a 4 MiB tensor and drops its own reference; after rank 1
has received it, rank 0 prints whether the tensor is still alive (held by the send's
work), whether the work says it completed, and whether dropping the work frees it. Why
the pipeline runtime waits for and drops its sends before the step's end
(``runtime/execution/pipeline.py``, ``StageExchange._release``).
"""

from __future__ import annotations

import gc
import os
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29617")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 0:
        t = torch.ones(1 << 20)
        work = dist.isend(t, 1, tag=3)
        ref = weakref.ref(t)
        del t
        gc.collect()
        dist.barrier()          # rank 1 has received it
        time.sleep(0.2)
        print(f"held by the pending work after the receive: {ref() is not None}; "
              f"is_completed(): {work.is_completed()}")
        del work
        gc.collect()
        print(f"held after dropping the work: {ref() is not None}")
    else:
        buf = torch.empty(1 << 20)
        dist.recv(buf, 0, tag=3)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, nprocs=2)
