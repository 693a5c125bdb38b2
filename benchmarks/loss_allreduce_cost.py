"""What the loss's own all-reduce costs a data-parallel step (issue 19), A/B in one job.

    python benchmarks/loss_allreduce_cost.py --models vit gpt mlp --steps 30 --rounds 4

On gloo ranks (4 by default), for each model of ``zoo_vs_ddp_fsdp.py`` (its workloads),
four steps, run in alternating order over the rounds and averaged (slowest rank, mean of
the timed steps):

- ``ddp``: DDP, each rank its share of the batch;
- ``ddp+loss``: the same plus one all-reduce of the loss (4 bytes), what torchalpa did to
  return one device's loss on every rank;
- ``torchalpa``: ``train_step``, the loss all-reduced in the last gradient bucket
  (``runtime.rewrites.loss_in_bucket``);
- ``torchalpa-own``: the same module with the ride given up, the loss all-reduced on
  its own (the step before issue 19).

Each torchalpa row also shows the collectives its step issued (counted at the
dispatcher, on rank 0, in the last step) next to the plan's list for that step.
"""

from __future__ import annotations

import argparse

from _launch import add_run_args, average_runs, launch, leave_with_result, method_order
from zoo_vs_ddp_fsdp import MODELS, add_workload_args, workload

METHODS = ("ddp", "ddp+loss", "torchalpa", "torchalpa-own")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["vit", "gpt", "mlp"], choices=MODELS)
    add_workload_args(p)
    add_run_args(p, steps=30)
    return p.parse_args(argv)


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    flags = [f"--batch={args.batch}", f"--mlp-batch={args.mlp_batch}", f"--steps={args.steps}",
             f"--rounds={args.rounds}", "--models", *args.models]
    result = launch(__file__, flags, nproc=args.nproc, port=29547)
    print(f"{result['world_size']} gloo ranks, Adam, {args.steps} steps per method (first "
          f"untimed), {args.rounds} round(s); ratios to ddp")
    for model, stats in result["models"].items():
        base = stats["ddp"]["step_s"]
        for name in METHODS:
            s = stats[name]
            print(f"{model:<6}{name:>15}{s['step_s'] * 1e3:>9.2f} ms{s['step_s'] / base:>7.3f}"
                  + (f"   issued {s['issued']}, planned {s['planned']}" if "issued" in s else ""))


def worker(args):
    import torch.distributed as dist

    from torchalpa.runtime.execution.mesh import init_distributed

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"world_size": world, "models": {}}
    for model_name in args.models:
        build, batch, loss_fn = workload(model_name, args)
        runs: dict[str, list] = {}
        for r in range(args.rounds):
            for name in method_order(list(METHODS), r):
                runs.setdefault(name, []).append(
                    measure(name, build, batch, loss_fn, args.steps, rank, world))
        averaged = average_runs(runs)
        for name in ("torchalpa", "torchalpa-own"):
            averaged[name].update(issued=runs[name][-1]["issued"],
                                  planned=runs[name][-1]["planned"])
        result["models"][model_name] = averaged
    leave_with_result(result, args.worker)


def measure(name, build, batch, loss_fn, steps, rank, world) -> dict:
    """One method's timed steps (``runtime.measurement.measure.timed_steps``)."""
    import gc

    import torch
    import torch.distributed as dist

    import torchalpa
    from torchalpa.runtime.execution.step import StepMode
    from torchalpa.runtime.measurement.baselines import batch_shard, wrap_ddp
    from torchalpa.runtime.measurement.comm_count import CollectiveCounter
    from torchalpa.runtime.measurement.measure import timed_steps

    gc.collect()
    dist.barrier()
    torch.manual_seed(0)
    model = build()
    extra: dict = {}
    if name.startswith("torchalpa"):
        pm = torchalpa.auto_parallel(model, batch, loss_fn,
                                     optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4))
        if name == "torchalpa-own":       # A/B only: the step as it was before issue 19
            pm._train_step_mode = StepMode.LOSS_FIRST   # train_step: the loss on its own

        def step():
            pm.train_step(*batch)
        s = timed_steps(step, max(steps - 1, 1))
        with CollectiveCounter.for_mesh(pm.mesh) as counter:
            step()
        extra = {"issued": sorted(r.bytes for r in counter.records),
                 "planned": sorted(c.bytes for c in pm.collectives_per_step(train_step=True))}
    else:
        ddp = wrap_ddp(model)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
        local = [batch_shard(x, rank, world) for x in batch]
        with_loss = name == "ddp+loss"

        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(*local[:-1]), local[-1])
            if with_loss:          # torchalpa's loss before issue 19: issued after forward
                handle = dist.all_reduce(loss.detach().clone(), async_op=True)
            loss.backward()
            if with_loss:
                handle.wait()      # pyright: ignore[reportPossiblyUnbound]
            opt.step()
        s = timed_steps(step, max(steps - 1, 1))
    s.update(extra, peak_bytes=0)       # memory is not what this compares
    return s


if __name__ == "__main__":
    main()
