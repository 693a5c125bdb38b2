"""A finished job exits 0, however its script ends: repeated torchrun launches on a loaded
machine, counted by exit status.

    python benchmarks/clean_exit.py --launches 20 --nproc 4 --hogs 2

Each launch is ``torchrun --standalone --nproc-per-node=NPROC`` of this script as a small
training job (auto_parallel on an MLP, Adam, three steps) that ends in one of three
spellings, taken in turn:

- ``shutdown``: ``torchalpa.shutdown()``;
- ``destroy``: ``dist.destroy_process_group()``, as PyTorch's tutorials end;
- ``nothing``: the script just ends.

``--hogs N`` keeps N busy-looping processes running meanwhile (a loaded machine is where
finished ranks used to abort at the interpreter's teardown: "terminate called without an
active exception", SIGABRT, and torchrun reports the job failed; runtime/resilience/clean_exit.py).
The table counts, per spelling, the launches, those that exited 0, the other exit
statuses, and the launches whose output shows an abort. The exit status is 1 if any
launch failed.

``--heartbeat-s S`` makes every rank's heartbeat beat every S seconds instead of 0.5, so
that a store request is almost always in flight at exit: the cause of those aborts, made
frequent enough to see in a few launches (it sets ``HEARTBEAT_S`` in
``torchalpa.runtime.resilience.heartbeat``, or in ``torchalpa.runtime.resilience.faults`` where it lived before).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import subprocess
import sys
import time

SPELLINGS = ("shutdown", "destroy", "nothing")
ABORT = "terminate called"
_HEARTBEAT_ENV = "TORCHALPA_BENCH_HEARTBEAT_S"


def job(spelling: str) -> None:
    """One rank of a launch: train three steps, then end as ``spelling`` says."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    import torchalpa

    if os.environ.get(_HEARTBEAT_ENV):
        _set_heartbeat(float(os.environ[_HEARTBEAT_ENV]))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))
    for _ in range(3):
        loss = pm.train_step(x, y)
    if dist.get_rank() == 0:
        print(f"clean_exit job ({spelling}): loss {loss.item():.4f}", flush=True)
    if spelling == "shutdown":
        torchalpa.shutdown()
    elif spelling == "destroy":
        dist.destroy_process_group()


def _set_heartbeat(seconds: float) -> None:
    import importlib
    for name in ("torchalpa.runtime.resilience.heartbeat", "torchalpa.runtime.resilience.faults"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "HEARTBEAT_S"):
            module.HEARTBEAT_S = seconds
            return
    raise RuntimeError("no HEARTBEAT_S found in torchalpa.runtime.resilience.heartbeat or .faults")


def _hog(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def launch(spelling: str, nproc: int, heartbeat_s: float | None) -> tuple[int, str, float]:
    """One torchrun launch: its exit status, its output and its seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.abspath(__file__), "--job", spelling]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if heartbeat_s is not None:
        env[_HEARTBEAT_ENV] = str(heartbeat_s)
    start = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return run.returncode, run.stdout + run.stderr, time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=20, help="launches per spelling")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--hogs", type=int, default=2, help="busy-looping processes meanwhile")
    p.add_argument("--spellings", default=",".join(SPELLINGS))
    p.add_argument("--heartbeat-s", type=float, default=None,
                   help="beat this often (stress: a store request in flight at exit)")
    p.add_argument("--job", choices=SPELLINGS, help=argparse.SUPPRESS)   # a rank of a launch
    args = p.parse_args()
    if args.job:
        job(args.job)
        return 0
    spellings = args.spellings.split(",")
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_hog, args=(stop,), daemon=True)
            for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    codes: dict[str, collections.Counter] = {s: collections.Counter() for s in spellings}
    aborts: collections.Counter = collections.Counter()
    seconds: collections.Counter = collections.Counter()
    try:
        for i in range(args.launches):
            for spelling in spellings:
                code, output, took = launch(spelling, args.nproc, args.heartbeat_s)
                codes[spelling][code] += 1
                seconds[spelling] += took
                aborted = output.count(ABORT)
                aborts[spelling] += aborted > 0
                print(f"launch {i + 1:3d} {spelling:9s} exit {code:3d}  {took:5.1f} s"
                      + (f"  {aborted} rank(s): {ABORT}" if aborted else ""), flush=True)
                if code != 0:
                    print("    " + "\n    ".join(output.strip().splitlines()[-8:]), flush=True)
    finally:
        stop.set()
        for h in hogs:
            h.join()
    beat = f"heartbeat every {args.heartbeat_s:g} s" if args.heartbeat_s else "default heartbeat"
    print(f"\n{args.nproc} ranks per launch, {args.hogs} CPU hog(s), {os.cpu_count()} CPUs, "
          f"{beat}, load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'ending':10s} {'launches':>8s} {'exit 0':>7s} {'aborted':>8s}  other exits   mean s")
    failed = 0
    for s in spellings:
        n = sum(codes[s].values())
        other = {c: k for c, k in codes[s].items() if c != 0}
        failed += n - codes[s][0]
        print(f"{s:10s} {n:8d} {codes[s][0]:7d} {aborts[s]:8d}  {str(other or '-'):12s} "
              f"{seconds[s] / max(n, 1):6.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
