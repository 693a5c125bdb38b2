"""The README's loop next to ``train_step`` and DDP, where the plan is DDP's, phase by phase.

    torchrun --standalone --nproc_per_node=4 benchmarks/loop_vs_ddp.py [--rounds 8]

The deep narrow MLP of ``zoo_vs_ddp_fsdp.py`` (64 Linear, 64 <-> 256, Adam), batch 2048,
planned with ``DataParallel()`` (DDP's plan). Per round, in alternating order: torchalpa by
the README's loop (``loss = pm(x, y)``, ``loss.backward()``, ``opt.step()``,
``opt.zero_grad()``), torchalpa by ``train_step``, and DDP on each rank's quarter of the
batch; ranks meet at a barrier before each. Prints rank 0's median milliseconds of each
phase (forward, backward, optimizer: ``step()`` then ``zero_grad()``, for the loop and DDP
alike), beside each the main thread's CPU time and the process's minor page faults (wall
time on a shared VM swings with the other jobs; CPU time much less), and the ratios of
both torchalpa steps to DDP's.
One thread per rank (``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import benchmark_process, mark, parser  # noqa: E402
from zoo_vs_ddp_fsdp import deep_narrow_mlp  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.runtime.measurement.baselines import batch_shard, wrap_ddp  # noqa: E402


def main():
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--batch", type=int, default=2048)
    args = p.parse_args()
    with benchmark_process(group="torchrun"):
        measure(args)


def measure(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, 64, generator=g), torch.randn(args.batch, 64, generator=g)
    torch.manual_seed(0)
    pm = torchalpa.auto_parallel(deep_narrow_mlp(), (x, y), F.mse_loss,
                                 method=torchalpa.DataParallel(),
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4))
    torch.manual_seed(0)
    ddp = wrap_ddp(deep_narrow_mlp())
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
    lx, ly = batch_shard(x, rank, world), batch_shard(y, rank, world)
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[tuple[float, int]]] = {}    # (main thread's CPU s, minor faults)

    def phases(prefix, forward, backward, step):
        marks = [mark()]
        loss = forward()
        marks.append(mark())
        backward(loss)
        marks.append(mark())
        step()
        marks.append(mark())
        for k, (a, b) in (("forward", marks[0:2]), ("backward", marks[1:3]),
                          ("optimizer", marks[2:4]), ("step", marks[0:4:3])):
            times.setdefault(f"{prefix} {k}", []).append(b[0] - a[0])
            cpu.setdefault(f"{prefix} {k}", []).append((b[1] - a[1], b[2] - a[2]))

    def loop():
        def step():
            pm.optimizer.step()
            pm.optimizer.zero_grad(set_to_none=True)
        phases("loop", lambda: pm(x, y), lambda loss: loss.backward(), step)

    def train_step():
        t0 = time.perf_counter()
        pm.train_step(x, y)
        times.setdefault("train_step step", []).append(time.perf_counter() - t0)

    def baseline():     # the same loop: zero_grad after the step, timed, as the loop's
        def step():
            ddp_opt.step()
            ddp_opt.zero_grad(set_to_none=True)
        phases("ddp", lambda: F.mse_loss(ddp(lx), ly), lambda loss: loss.backward(), step)

    methods = [loop, train_step, baseline]
    for f in methods:        # warm-up
        f()
    times.clear()
    for r in range(args.rounds):
        for f in methods if r % 2 == 0 else reversed(methods):
            dist.barrier()
            f()
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{world} gloo ranks, batch {args.batch}, {args.rounds} rounds; median ms (rank 0)"
              "; CPU ms of the main thread and its minor page faults, median")
        for k, v in med.items():
            extra = ""
            if k in cpu:
                c = statistics.median(t for t, _ in cpu[k]) * 1e3
                extra = f"   cpu {c:6.1f}   faults {statistics.median(f for _, f in cpu[k]):6.0f}"
            print(f"  {k:<20}{v:>8.1f}{extra}")
        print(f"loop / DDP {med['loop step'] / med['ddp step']:.3f}   "
              f"train_step / DDP {med['train_step step'] / med['ddp step']:.3f}   "
              f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
