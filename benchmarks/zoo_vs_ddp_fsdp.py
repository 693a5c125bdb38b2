"""Every zoo model under DDP, FSDP2 and torchalpa's automatic plan, in one job on gloo ranks.

    python benchmarks/zoo_vs_ddp_fsdp.py                         # all models, 4 ranks
    python benchmarks/zoo_vs_ddp_fsdp.py --models gpt mlp --steps 3

Launches one torchrun job (inside shared/tools/netns_bytes.sh when run as root, so the
loopback bytes per step are exactly what the ranks exchanged) that trains, model by model,
each of the zoo's families (``torchalpa.models.tiny``: gpt, llama, bert, vit, resnet, moe,
dropout off) and a deep, narrow MLP (64 Linear layers alternating 64 -> 256 -> 64, ReLU,
where the plan is DDP's and per-collective latency dominates) with Adam, once per method:
torchalpa (``auto_parallel``, every rank passing the global batch), DDP and FSDP2
(``fully_shard`` per layer, as torchtitan applies it; each rank its share of the batch);
``--methods ... torchalpa-dp`` adds torchalpa with ``method=DataParallel()`` (DDP's plan),
``torchalpa-loop`` torchalpa stepped by the README's loop (``loss = pm(x, y)``,
``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``) instead of ``train_step``.
Each torchalpa row shows its plan with the estimated step time, and the header the cluster
auto_parallel planned for (on gloo, measured on the live group: ``Cluster.measure()``).

For each: step time (slowest rank, mean of the timed steps after one warm-up), loopback
bytes per step, peak resident memory per rank (the largest over ranks; the whole process),
and torchalpa's ratios to the faster of DDP and FSDP2. On a shared machine the times move
with the load: ``--rounds 2`` alternates the order of the methods and averages.
"""

from __future__ import annotations

import argparse
import dataclasses

from _launch import add_run_args, average_runs, launch, leave_with_result, method_order

METHODS = ("torchalpa", "ddp", "fsdp2")
EXTRA_METHODS = ("torchalpa-dp",     # torchalpa with method=DataParallel(): DDP's plan
                 "torchalpa-loop")   # torchalpa stepped by the README's loop, not train_step
ZOO = ("gpt", "llama", "bert", "vit", "resnet", "moe")
MODELS = ZOO + ("mlp",)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    p.add_argument("--methods", nargs="*", default=list(METHODS),
                   choices=METHODS + EXTRA_METHODS)
    add_workload_args(p)
    add_run_args(p, steps=4)
    return p.parse_args(argv)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """--batch and --mlp-batch, the global batches ``workload`` builds."""
    p.add_argument("--batch", type=int, default=16, help="global batch of the zoo models")
    p.add_argument("--mlp-batch", type=int, default=2048, help="global batch of the MLP")


# -- the launcher -------------------------------------------------------------------------

def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    flags = [f"--batch={args.batch}", f"--mlp-batch={args.mlp_batch}",
             f"--steps={args.steps}", f"--rounds={args.rounds}",
             "--models", *args.models, "--methods", *args.methods]
    report(args, launch(__file__, flags, nproc=args.nproc, port=29543))


def report(args, result):
    print(f"{result['world_size']} gloo ranks, Adam, {args.steps} steps per method (first "
          f"untimed), {args.rounds} round(s); zoo batch {args.batch}, MLP batch "
          f"{args.mlp_batch}; ratios: torchalpa / the faster of DDP and FSDP2")
    if result.get("cluster"):
        print(f"torchalpa planned for: {result['cluster']}")
    head = (f"{'model':<8}{'params':>8}{'method':>14}{'step ms':>10}{'loopback MiB':>14}"
            f"{'peak RSS GiB':>14}")
    print(head)
    for model, row in result["models"].items():
        for name, s in row["stats"].items():
            print(f"{model:<8}{row['num_params'] / 1e6:>7.2f}M{name:>14}{s['step_s'] * 1e3:>10.1f}"
                  f"{s['loopback_bytes_per_step'] / 2**20:>14.2f}{s['peak_bytes'] / 2**30:>14.2f}"
                  + (f"   plan: {s['plan']}" if "plan" in s else ""))
        others = [s for k, s in row["stats"].items() if k in ("ddp", "fsdp2")]
        for name, ours in row["stats"].items():
            if not name.startswith("torchalpa") or not others:
                continue
            best = min(others, key=lambda s: s["step_s"])
            label = "ratio" if name == "torchalpa" else f"ratio {name[len('torchalpa-'):]}"
            print(f"{model:<8}{'':>8}{label:>14}{ours['step_s'] / best['step_s']:>10.2f}"
                  f"{ours['loopback_bytes_per_step'] / max(best['loopback_bytes_per_step'], 1):>14.2f}"
                  f"{ours['peak_bytes'] / best['peak_bytes']:>14.2f}")


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

    from torchalpa.parallel.workflow import default_cluster
    from torchalpa.passes.sharding.ilp import InfeasibleError
    from torchalpa.runtime.execution.mesh import init_distributed

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cluster = default_cluster(world, measure=True)      # what auto_parallel will plan for
    result = {"world_size": world, "models": {}, "cluster": (
        f"{cluster.device_name or cluster.name}: {cluster.peak_flops / 1e9:.3g} Gflop/s per "
        f"rank, collective latency {cluster.intra_node_latency * 1e3:.3g} ms, "
        f"{cluster.intra_node_bandwidth / 1e9:.3g} GB/s")}
    for model_name in args.models:
        build, batch, loss_fn = workload(model_name, args)
        runs: dict[str, list] = {}
        num_params = 0
        for r in range(args.rounds):
            for name in method_order(args.methods, r):
                try:
                    s, num_params = measure(name, build, batch, loss_fn, args, rank, world)
                except InfeasibleError as e:      # every rank gets rank 0's planning error
                    if name != "torchalpa-dp":
                        raise
                    if rank == 0:
                        print(f"{model_name} {name}: no DataParallel plan ({e})", flush=True)
                    continue
                runs.setdefault(name, []).append(s)
                if rank == 0:
                    print(f"{model_name} {name}: {s['step_s'] * 1e3:.1f} ms/step", flush=True)
        result["models"][model_name] = {"stats": average_runs(runs), "num_params": num_params}
    leave_with_result(result, args.worker)


def measure(name, build, batch, loss_fn, args, rank, world):
    """One method on one model (``torchalpa.cli.bench.measure_method``); torchalpa-dp is
    torchalpa with ``method=DataParallel()``."""
    import torchalpa
    from torchalpa.cli.bench import measure_method
    method = torchalpa.DataParallel() if name == "torchalpa-dp" else None
    return measure_method("torchalpa" if name == "torchalpa-dp" else name, build, batch,
                          loss_fn, steps=args.steps, rank=rank, world=world, method=method)


if __name__ == "__main__":
    main()
