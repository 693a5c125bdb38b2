"""A GPT-2-small-shaped model on 4 gloo ranks: torchalpa next to DDP and FSDP2, in one run.

    python benchmarks/gpt_vs_ddp.py                       # 12 layers, hidden 768, seq 256, batch 16
    python benchmarks/gpt_vs_ddp.py --layers 2 --steps 2  # a quick look

Launches one torchrun job (inside shared/tools/netns_bytes.sh when run as root, so the
loopback bytes per step are exactly what the ranks exchanged) that trains the zoo's GPT
(torchalpa.models.GPT: learned positions, pre-LayerNorm, GELU MLP, tied head; dropout off so
all methods compute the same thing) with Adam, once per method: torchalpa (the automatic
plan, every rank passing the global batch), DDP and FSDP2 (each rank its quarter of the
batch). For each: step time (slowest rank, mean of the timed steps after one warm-up),
loopback bytes per step, peak resident memory per rank (the largest over ranks; the whole
process, so it includes ~0.3 GiB of libraries) and model-state bytes per rank.
"""

from __future__ import annotations

import argparse
import gc
import json

from _launch import add_run_args, average_runs, describe_plan, launch, method_order, peak_over_ranks

METHODS = ("torchalpa", "ddp", "fsdp2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    add_run_args(p, steps=3)
    return p.parse_args(argv)


# -- the launcher -------------------------------------------------------------------------

def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    flags = [f"--{k}={getattr(args, k)}" for k in
             ("layers", "hidden", "heads", "seq", "batch", "vocab", "steps", "rounds")]
    report(args, launch(__file__, [*flags, "--methods", *args.methods], nproc=args.nproc,
                        port=29541))


def report(args, result):
    stats = result["stats"]
    base = stats.get("ddp") or next(iter(stats.values()))
    print(f"GPT: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
          f"batch {args.batch}, vocab {args.vocab} ({result['num_params'] / 1e6:.1f} M "
          f"parameters); {result['world_size']} gloo ranks, Adam, {args.steps} steps per "
          f"method (first untimed), {args.rounds} round(s)")
    ref = "DDP" if "ddp" in stats else "first"
    print(f"{'method':<10}{'step s':>9}{'x ' + ref:>7}{'loopback/step MiB':>19}{'x ' + ref:>7}"
          f"{'peak RSS/rank GiB':>19}{'x ' + ref:>7}{'state/rank MiB':>16}")
    for name, s in stats.items():
        print(f"{name:<10}{s['step_s']:>9.2f}{s['step_s'] / base['step_s']:>7.2f}"
              f"{s['loopback_bytes_per_step'] / 2**20:>19.1f}"
              f"{s['loopback_bytes_per_step'] / max(base['loopback_bytes_per_step'], 1):>7.2f}"
              f"{s['peak_bytes'] / 2**30:>19.2f}{s['peak_bytes'] / base['peak_bytes']:>7.2f}"
              f"{s['state'] / 2**20:>16.1f}")
    if args.rounds > 1:
        print("step s per round: " + "; ".join(
            f"{k} " + ", ".join(f"{t:.2f}" for t in s["step_s_per_round"])
            for k, s in stats.items()))
    ta = stats.get("torchalpa")
    if ta:
        print(f"torchalpa: planned in {ta['setup_s']:.1f} s, {ta['plan']}; planned "
              f"{ta['planned_wire_bytes_per_step'] / 2**20:.1f} MiB per step")
        if ta.get("unsupported_ops"):
            print(f"ops without a sharding rule (replicated): {ta['unsupported_ops']}")
    print("losses after the last step: " + ", ".join(f"{k} {s['loss']:.4f}"
                                                      for k, s in stats.items()))


# -- the worker (one per rank, under torchrun) -----------------------------------------------

def worker(args):
    import torch
    import torch.distributed as dist

    import torchalpa
    from torchalpa.models import GPT, GPTConfig, lm_loss
    from torchalpa.runtime.execution.mesh import init_distributed
    from torchalpa.runtime.measurement.baselines import batch_shard, wrap_ddp, wrap_fsdp2
    from torchalpa.runtime.measurement.measure import (
        model_state_bytes,
        reset_peak_memory,
        timed_steps,
    )

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPTConfig(vocab_size=args.vocab, max_seq_len=args.seq, num_layers=args.layers,
                       num_heads=args.heads, hidden=args.hidden, dropout=0.0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()       # (B, T) each

    def build():
        torch.manual_seed(0)
        return GPT(config)

    stats, extra = {}, {}
    order = [name for r in range(args.rounds) for name in method_order(args.methods, r)]
    for name in order:
        gc.collect()
        dist.barrier()
        reset_peak_memory()
        import time
        start = time.perf_counter()
        if name == "torchalpa":
            model = build()
            pm = torchalpa.auto_parallel(model, (x, y), lm_loss,
                                         optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4))
            setup = time.perf_counter() - start
            opt, params = pm.optimizer, list(pm.parameters())

            def step():
                step.loss = pm.train_step(x, y).item()  # noqa: F821 (the closure names itself)
            extra = {"setup_s": setup,
                     "plan": describe_plan(pm.plan, pm.collectives_per_step(train_step=True)),
                     "planned_wire_bytes_per_step": pm.plan.estimates["wire_bytes_per_step"],
                     "unsupported_ops": sorted({u["op"] for u in pm.plan.unsupported_ops})}
        else:
            model = build()
            model = wrap_ddp(model) if name == "ddp" else wrap_fsdp2(model)
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)
            params = list(model.parameters())
            xs, ys = batch_shard(x, rank, world), batch_shard(y, rank, world)

            def step(model=model, opt=opt, xs=xs, ys=ys):
                opt.zero_grad(set_to_none=True)
                loss = lm_loss(model(xs), ys)
                loss.backward()
                opt.step()
                mean = loss.detach().clone()          # the global batch's loss, as reported
                dist.all_reduce(mean, op=dist.ReduceOp.AVG)
                step.loss = mean.item()  # noqa: F821 (the closure names itself)
            extra = {}
        s = timed_steps(step, max(args.steps - 1, 1))
        s["state"] = model_state_bytes(params, opt)
        s["peak_bytes"] = peak_over_ranks()
        s["loss"] = step.loss
        s.update(extra)
        stats.setdefault(name, []).append(s)
        if rank == 0:
            print(f"{name}: {s['step_s']:.2f} s/step, peak {s['peak_bytes'] / 2**30:.2f} GiB",
                  flush=True)
        num_params = sum(p.numel() for p in params)
        del model, opt, params, step
        pm = None  # noqa: F841
    if rank == 0:
        averaged = average_runs(stats)
        with open(args.worker, "w") as f:
            json.dump({"world_size": world, "stats": averaged, "num_params": num_params}, f,
                      indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
