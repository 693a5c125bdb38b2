"""Side by side: torchalpa's automatic plan, DDP and FSDP2 on the same model, under torchrun.

``torchalpa bench MODULE:WORKLOAD --nproc 4 --steps 3`` and the scripts in ``benchmarks/``
share this module. A benchmark runs twice: as the *launcher* (``launch``), which starts
torchrun on a worker -- a script, or this module (``python -m torchalpa.cli.bench``) -- with
``--worker PATH``, and as each *rank*, which trains every method in turn
(``measure_method``) and has rank 0 write the JSON result to PATH for the launcher to
report (``format_table``).

Backends follow the ranks' devices (``runtime.execution.mesh``): NCCL on GPUs, gloo on CPUs. Every
method trains the same model (rebuilt from seed 0 for each) with Adam: torchalpa
(``auto_parallel``, each rank passing the global batch), DDP and FSDP2 (``fully_shard``
per layer, as torchtitan applies it; each rank its share of the batch).

Measured per method: step time (the slowest rank, mean of the timed steps after one
warm-up), peak memory (the largest over ranks: CUDA allocator peak, or the process's peak
resident set on a CPU) and bytes sent per step where they can be measured: the loopback
bytes of the job when the launcher runs inside ``shared/tools/netns_bytes.sh`` (root: a
private network namespace, so they are the job's own), else, for torchalpa only, the bytes
its collectives were handed (``pm.last_step_stats().measured_bytes_sent``, summed over
ranks); DDP and FSDP2 then show "-".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import NoReturn

__all__ = ["METHODS", "launch", "method_order", "average_runs", "peak_over_ranks",
           "describe_plan", "measure_method", "run_bench", "format_table", "leave_with_result"]

METHODS = ("torchalpa", "ddp", "fsdp2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# shared/ sits beside the checkout (/work/main) or two levels up (a worktree, /work/wt/x)
NETNS = next((p for p in (os.path.join(ROOT, *[".."] * up, "shared", "tools", "netns_bytes.sh")
                          for up in (1, 2)) if os.path.exists(p)), "netns_bytes.sh")


# -- the launcher ---------------------------------------------------------------------------

def in_netns() -> bool:
    """Whether ``launch`` runs the job in a private network namespace (exact loopback bytes)."""
    return os.path.exists(NETNS) and os.geteuid() == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, flags: list[str], *, nproc: int, port: int | None = None,
           quiet_netns: bool = False) -> dict:
    """Run ``script`` (a ``.py`` path, or a module name run as ``-m``) under torchrun on
    ``nproc`` local ranks with ``flags`` and a ``--worker`` path, and return the JSON its
    rank 0 wrote there. ``port`` None takes a free one. Raises ``RuntimeError`` with the
    job's output on failure."""
    out = os.path.join(tempfile.mkdtemp(), "result.json")
    target = [os.path.abspath(script)] if script.endswith(".py") else ["-m", script]
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                "--master_addr=127.0.0.1", f"--master_port={port or _free_port()}", *target,
                *flags, "--worker", out]
    netns = in_netns()
    if not netns and not quiet_netns:
        print("warning: not inside shared/tools/netns_bytes.sh (missing, or not root); "
              "loopback bytes will include other local traffic", file=sys.stderr)
    cmd = ["bash", NETNS, *torchrun] if netns else torchrun
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHALPA_TIMEOUT_S="1800")
    env.setdefault("TORCHALPA_LOG", "warning")
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the benchmark job failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    with open(out) as f:
        result = json.load(f)
    result["loopback_exact"] = netns
    return result


def method_order(methods, round_index: int) -> list[str]:
    """The methods in the order of round ``round_index``: as given, then reversed, ..."""
    return list(methods) if round_index % 2 == 0 else list(reversed(methods))


def average_runs(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per method, its last run's record with step time and bytes averaged over the
    rounds, the largest peak memory, and each round's step time."""
    out = {}
    for name, rs in runs.items():
        out[name] = dict(rs[-1])
        for key in ("step_s", "loopback_bytes_per_step"):
            out[name][key] = sum(r[key] for r in rs) / len(rs)
        out[name]["peak_bytes"] = max(r["peak_bytes"] for r in rs)
        out[name]["step_s_per_round"] = [r["step_s"] for r in rs]
    return out


# -- each rank --------------------------------------------------------------------------------

def peak_over_ranks() -> int:
    """The largest peak memory of any rank (collective)."""
    import torch
    import torch.distributed as dist

    from torchalpa.runtime.measurement.measure import peak_memory_bytes
    peak = torch.tensor([peak_memory_bytes()], dtype=torch.int64, device=_device_for(dist))
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def _device_for(dist):
    """Where this group's collectives take their tensors (the GPU for NCCL)."""
    from torchalpa.runtime.execution.mesh import default_device
    return default_device() if dist.get_backend() == "nccl" else "cpu"


def describe_plan(plan, collectives=None) -> str:
    """Mesh, parameter layouts, the collectives one step issues (buckets counted once;
    ``collectives``: that list, e.g. ``pm.collectives_per_step(train_step=True)``, where
    the loss may ride a bucket; default: a step by ``loss.backward()``) and the estimated
    step time."""
    from torchalpa.runtime.measurement.issued import issued_collectives
    layouts: dict[str, int] = {}
    for v in plan.parameters:
        key = "".join(str(p) for p in v.placements)
        layouts[key] = layouts.get(key, 0) + 1
    kinds: dict[str, int] = {}
    for c in issued_collectives(plan) if collectives is None else collectives:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    return (f"mesh {list(plan.mesh_shape)}, layouts {layouts}, collectives {kinds}, "
            f"est {plan.estimates.step_time_s * 1e3:.3g} ms")


def measure_method(name: str, build: Callable, batch: tuple, loss_fn, *, steps: int,
                   rank: int, world: int, method=None) -> tuple[dict, int]:
    """Train ``build()`` (seeded 0) on ``batch`` under ``name`` (torchalpa, ddp or fsdp2)
    with Adam: timed steps, loopback bytes, peak memory over ranks; and the parameter
    count. ``method`` is torchalpa's method (None: automatic). ``torchalpa`` steps by
    ``train_step``; ``torchalpa-loop`` by the README's loop (``loss = pm(*batch)``,
    ``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``): the autograd path."""
    import torch
    import torch.distributed as dist

    import torchalpa
    from torchalpa.runtime.execution.mesh import default_device
    from torchalpa.runtime.measurement.baselines import batch_shard, wrap_ddp, wrap_fsdp2
    from torchalpa.runtime.measurement.measure import reset_peak_memory, timed_steps

    gc.collect()
    dist.barrier()
    reset_peak_memory()
    torch.manual_seed(0)
    model = build()
    extra: dict = {}
    pm = None
    if name.startswith("torchalpa"):
        start = time.perf_counter()
        pm = torchalpa.auto_parallel(model, batch, loss_fn, method=method,
                                     optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4))
        extra = {"setup_s": time.perf_counter() - start, "plan": describe_plan(
            pm.plan, pm.collectives_per_step(train_step=True))}
        params = list(pm.parameters())

        if name == "torchalpa-loop":
            opt = pm.optimizer
            assert opt is not None    # auto_parallel was given one

            def step():
                loss = pm(*batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            def step():
                pm.train_step(*batch)
    elif name in ("ddp", "fsdp2"):
        model = wrap_ddp(model) if name == "ddp" else wrap_fsdp2(model.to(default_device()))
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        params = list(model.parameters())
        local = [batch_shard(x, rank, world).to(default_device()) for x in batch]

        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(*local[:-1]), local[-1]) if loss_fn is not None \
                else model(*local)
            loss.backward()
            opt.step()
    else:
        raise ValueError(f"unknown method {name!r}; choose from {METHODS}")
    s = timed_steps(step, max(steps - 1, 1))
    s["peak_bytes"] = peak_over_ranks()
    if pm is not None:
        s["collective_bytes_per_step"] = _sum_over_ranks(_measured_bytes(pm))
    s.update(extra)
    return s, sum(p.numel() for p in params)


def _measured_bytes(pm) -> int | None:
    stats = pm.last_step_stats()
    return getattr(stats, "measured_bytes_sent", None)


def _sum_over_ranks(value: int | None) -> int | None:
    import torch
    import torch.distributed as dist
    if value is None:
        return None
    t = torch.tensor([value], dtype=torch.int64, device=_device_for(dist))
    dist.all_reduce(t)
    return int(t.item())


def worker(args) -> None:
    """One rank of ``torchalpa bench``: every method on the model, rank 0 writes the result."""
    import torch
    import torch.distributed as dist

    from torchalpa.cli.workloads import load_workload
    from torchalpa.runtime.execution.mesh import init_distributed

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    load = load_workload(args.model)
    torch.manual_seed(1)          # the same batch on every rank
    _, batch, loss_fn = load()

    def build():
        return load()[0]
    runs: dict[str, list] = {}
    num_params = 0
    for r in range(args.rounds):
        for name in method_order(args.methods, r):
            s, num_params = measure_method(name, build, tuple(batch), loss_fn, steps=args.steps,
                                           rank=rank, world=world)
            runs.setdefault(name, []).append(s)
    leave_with_result({"world_size": world, "backend": dist.get_backend(), "model": args.model,
                       "num_params": num_params, "steps": args.steps,
                       "stats": average_runs(runs)}, args.worker)


def leave_with_result(result: dict, path: str) -> NoReturn:
    """A worker's end: rank 0 writes ``result`` as JSON to ``path`` (the launcher reads it),
    every rank leaves the process group and the process exits now."""
    import torch.distributed as dist
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    # The result is written and every rank has left the group: skip interpreter teardown,
    # where gloo threads still holding work objects can abort the process ("terminate
    # called without an active exception"), failing a job whose work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the report -------------------------------------------------------------------------------

def run_bench(model: str, *, nproc: int, steps: int, rounds: int = 1,
              methods=METHODS) -> dict:
    """Launch ``model`` (a zoo family or ``module:callable``) under torchrun on ``nproc``
    ranks, every method ``steps`` steps (the first untimed), and return the result."""
    if nproc < 1 or steps < 1 or rounds < 1:
        raise ValueError(f"--nproc, --steps and --rounds must be >= 1, got {nproc}, {steps}, "
                         f"{rounds}")
    flags = [f"--model={model}", f"--steps={steps}", f"--rounds={rounds}",
             "--methods", *methods]
    return launch("torchalpa.cli.bench", flags, nproc=nproc, quiet_netns=True)


def table_rows(result: dict) -> list[tuple[str, str, str, str, str]]:
    """(method, step ms, ratio to the faster baseline, MiB sent per step, peak MiB) per
    method; a figure that was not measured is '-'."""
    stats = result["stats"]
    baselines = [s["step_s"] for k, s in stats.items() if k in ("ddp", "fsdp2")]
    best = min(baselines) if baselines else None
    rows = []
    for name, s in stats.items():
        if result.get("loopback_exact"):
            sent = s["loopback_bytes_per_step"]
        else:
            sent = s.get("collective_bytes_per_step")
        rows.append((name, f"{s['step_s'] * 1e3:.1f}",
                     f"{s['step_s'] / best:.2f}" if best else "-",
                     f"{sent / 2**20:.3f}" if sent is not None else "-",
                     f"{s['peak_bytes'] / 2**20:.0f}"))
    return rows


def format_table(result: dict):
    """The result as one ``rich`` table (print it with ``rich.print``)."""
    from rich.table import Table
    exact = result.get("loopback_exact")
    table = Table(title=f"{result['model']}: {result['num_params'] / 1e6:.2f} M parameters, "
                        f"{result['world_size']} {result['backend']} ranks, Adam, "
                        f"{result['steps']} steps per method (first untimed)",
                  caption="ratio: step time over the faster of DDP and FSDP2; sent: "
                          + ("loopback bytes of the job (private network namespace)" if exact
                             else "bytes handed to torchalpa's collectives, all ranks "
                                  "(not measurable for DDP/FSDP2 outside "
                                  "shared/tools/netns_bytes.sh)")
                          + "; peak: the largest rank's "
                          + ("CUDA allocator peak" if result["backend"] == "nccl"
                             else "peak resident set"))
    for column in ("method", "step ms", "ratio", "sent MiB/step", "peak MiB"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in table_rows(result):
        table.add_row(*row)
    return table


def _parse_worker_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m torchalpa.cli.bench",
                                description="one rank of `torchalpa bench` (under torchrun)")
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    p.add_argument("--worker", required=True)
    return p.parse_args(argv)


if __name__ == "__main__":
    worker(_parse_worker_args())
