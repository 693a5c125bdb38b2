"""Every zoo model under DDP, FSDP2 and torchalpa's automatic plan, in one job on gloo ranks.

    python benchmarks/zoo_vs_ddp_fsdp.py                         # all models, 4 ranks
    python benchmarks/zoo_vs_ddp_fsdp.py --models gpt mlp --steps 3

Launches one torchrun job (inside shared/tools/netns_bytes.sh when run as root, so the
loopback bytes per step are exactly what the ranks exchanged) that trains, model by model,
each of the zoo's families (``torchalpa.models.tiny``: gpt, llama, bert, vit, resnet, moe,
dropout off) and a deep, narrow MLP (64 Linear layers alternating 64 -> 256 -> 64, ReLU,
where the plan is DDP's and per-collective latency dominates) with Adam, once per method:
torchalpa (``auto_parallel``, every rank passing the global batch), DDP and FSDP2
(``fully_shard`` per layer, as torchtitan applies it; each rank its share of the batch).

For each: step time (slowest rank, mean of the timed steps after one warm-up), loopback
bytes per step, peak resident memory per rank (the largest over ranks; the whole process),
and torchalpa's ratios to the faster of DDP and FSDP2. On a shared machine the times move
with the load: ``--rounds 2`` alternates the order of the methods and averages.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# shared/ sits beside the checkout (/work/main) or two levels up (a worktree, /work/wt/x)
NETNS = next((p for p in (os.path.join(ROOT, *[".."] * up, "shared", "tools", "netns_bytes.sh")
                          for up in (1, 2)) if os.path.exists(p)), "netns_bytes.sh")
METHODS = ("torchalpa", "ddp", "fsdp2")
ZOO = ("gpt", "llama", "bert", "vit", "resnet", "moe")
MODELS = ZOO + ("mlp",)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    p.add_argument("--batch", type=int, default=16, help="global batch of the zoo models")
    p.add_argument("--mlp-batch", type=int, default=2048, help="global batch of the MLP")
    p.add_argument("--steps", type=int, default=4, help="steps per method, the first untimed")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the methods this many times in alternating order and average")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)   # JSON path, in torchrun
    return p.parse_args(argv)


# -- the launcher -------------------------------------------------------------------------

def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    out = os.path.join(tempfile.mkdtemp(), "zoo.json")
    flags = [f"--batch={args.batch}", f"--mlp-batch={args.mlp_batch}",
             f"--steps={args.steps}", f"--rounds={args.rounds}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
                "--master_addr=127.0.0.1", "--master_port=29543", os.path.abspath(__file__),
                *flags, "--models", *args.models, "--methods", *args.methods, "--worker", out]
    in_netns = os.path.exists(NETNS) and os.geteuid() == 0
    if not in_netns:
        print("warning: not inside shared/tools/netns_bytes.sh (missing, or not root); "
              "loopback bytes will include other local traffic", file=sys.stderr)
    cmd = ["bash", NETNS, *torchrun] if in_netns else torchrun
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHALPA_TIMEOUT_S="1800",
               TORCHALPA_LOG="warning")
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True)
    if proc.returncode != 0:
        sys.exit(f"the benchmark failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    report(args, json.load(open(out)))


def report(args, result):
    print(f"{result['world_size']} gloo ranks, Adam, {args.steps} steps per method (first "
          f"untimed), {args.rounds} round(s); zoo batch {args.batch}, MLP batch "
          f"{args.mlp_batch}; ratios: torchalpa / the faster of DDP and FSDP2")
    head = (f"{'model':<8}{'params':>8}{'method':>11}{'step ms':>10}{'loopback MiB':>14}"
            f"{'peak RSS GiB':>14}")
    print(head)
    for model, row in result["models"].items():
        for name, s in row["stats"].items():
            print(f"{model:<8}{row['num_params'] / 1e6:>7.2f}M{name:>11}{s['step_s'] * 1e3:>10.1f}"
                  f"{s['loopback_bytes_per_step'] / 2**20:>14.2f}{s['peak_bytes'] / 2**30:>14.2f}")
        ours = row["stats"].get("torchalpa")
        others = [s for k, s in row["stats"].items() if k != "torchalpa"]
        if ours and others:
            best = min(others, key=lambda s: s["step_s"])
            print(f"{model:<8}{'':>8}{'ratio':>11}{ours['step_s'] / best['step_s']:>10.2f}"
                  f"{ours['loopback_bytes_per_step'] / max(best['loopback_bytes_per_step'], 1):>14.2f}"
                  f"{ours['peak_bytes'] / best['peak_bytes']:>14.2f}"
                  f"   plan: {ours['plan']}")


# -- the worker (one per rank, under torchrun) -----------------------------------------------

def deep_narrow_mlp():
    """64 Linear layers alternating 64 -> 256 -> 64 with ReLU between."""
    import torch.nn as nn
    layers = []
    for i in range(64):
        layers.append(nn.Linear(64, 256) if i % 2 == 0 else nn.Linear(256, 64))
        if i < 63:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def workload(name: str, args):
    """(build, batch, loss_fn): a fresh model from seed 0, the global batch, its loss."""
    import torch
    import torch.nn.functional as F

    import torchalpa.models as zoo
    if name == "mlp":
        g = torch.Generator().manual_seed(1)
        batch = (torch.randn(args.mlp_batch, 64, generator=g),
                 torch.randn(args.mlp_batch, 64, generator=g))
        return deep_narrow_mlp, batch, F.mse_loss
    w = zoo.tiny(name, batch_size=args.batch)
    if dataclasses.is_dataclass(w.config) and any(
            f.name == "dropout" for f in dataclasses.fields(w.config)):
        w = w.replace(dropout=0.0)         # every method computes the same thing
    torch.manual_seed(1)
    return w.build, tuple(w.example_inputs()), w.loss_fn


def worker(args):
    import torch.distributed as dist

    from torchalpa.runtime.mesh import init_distributed

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"world_size": world, "models": {}}
    for model_name in args.models:
        build, batch, loss_fn = workload(model_name, args)
        runs: dict[str, list] = {}
        num_params = 0
        for r in range(args.rounds):
            order = list(args.methods) if r % 2 == 0 else list(reversed(args.methods))
            for name in order:
                s, num_params = measure(name, build, batch, loss_fn, args, rank, world)
                runs.setdefault(name, []).append(s)
                if rank == 0:
                    print(f"{model_name} {name}: {s['step_s'] * 1e3:.1f} ms/step", flush=True)
        stats = {}
        for name, rs in runs.items():
            stats[name] = dict(rs[-1])
            for key in ("step_s", "loopback_bytes_per_step"):
                stats[name][key] = sum(x[key] for x in rs) / len(rs)
            stats[name]["peak_bytes"] = max(x["peak_bytes"] for x in rs)
        result["models"][model_name] = {"stats": stats, "num_params": num_params}
    if rank == 0:
        with open(args.worker, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def measure(name, build, batch, loss_fn, args, rank, world):
    """One method on one model: timed steps, loopback bytes, peak memory over ranks."""
    import torch
    import torch.distributed as dist

    import torchalpa
    from torchalpa.runtime.baselines import batch_shard, wrap_ddp, wrap_fsdp2
    from torchalpa.runtime.measure import peak_memory_bytes, reset_peak_memory, timed_steps

    gc.collect()
    dist.barrier()
    reset_peak_memory()
    torch.manual_seed(0)
    model = build()
    extra = {}
    if name == "torchalpa":
        start = time.perf_counter()
        pm = torchalpa.auto_parallel(model, batch, loss_fn,
                                     optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4))
        extra = {"setup_s": time.perf_counter() - start, "plan": describe(pm.plan)}
        params = list(pm.parameters())

        def step():
            pm.train_step(*batch)
    else:
        model = wrap_ddp(model) if name == "ddp" else wrap_fsdp2(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        params = list(model.parameters())
        local = [batch_shard(x, rank, world) for x in batch]

        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(*local[:-1]), local[-1])
            loss.backward()
            opt.step()
    s = timed_steps(step, max(args.steps - 1, 1))
    peak = torch.tensor([peak_memory_bytes()], dtype=torch.int64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    s["peak_bytes"] = int(peak.item())
    s.update(extra)
    num_params = sum(p.numel() for p in params)
    return s, num_params


def describe(plan) -> str:
    """Mesh, parameter layouts and the collectives one step issues (buckets counted once)."""
    from torchalpa.runtime.buckets import issued_collectives
    layouts: dict[str, int] = {}
    for v in plan.parameters:
        key = "".join(str(p) for p in v.placements)
        layouts[key] = layouts.get(key, 0) + 1
    kinds: dict[str, int] = {}
    for c in issued_collectives(plan):
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    return f"mesh {list(plan.mesh_shape)}, layouts {layouts}, collectives {kinds}"


if __name__ == "__main__":
    main()
