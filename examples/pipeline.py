"""A GPT trained with Alpa's pipeshard parallelism: stages on submeshes, micro-batches.

    torchrun --nproc_per_node=4 examples/pipeline.py                  # search stages
    torchrun --nproc_per_node=4 examples/pipeline.py --stages 2       # 2 stages x 2 ranks
    torchrun --nproc_per_node=4 examples/pipeline.py --schedule gpipe --micro-batches 8
    torchrun --nproc_per_node=4 examples/pipeline.py --profile       # time layers first

torchalpa clusters the training step into layers, picks stages and submeshes with Alpa's
dynamic program (or takes ``--stages N`` equal ones; ``--profile`` feeds the program layer
times measured on these ranks instead of the cost model's), shards each stage over its submesh
with the intra-op ILP, and runs the micro-batches with a 1F1B or GPipe schedule. Every rank
builds the same model and passes the same global batch. The script prints the plan (stages,
submeshes, estimated timeline), trains, and checks every step's loss and the final
parameters against single-device training on the same global batch.
"""

import argparse

import torch
import torch.distributed as dist

import torchalpa
import torchalpa.models as zoo


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    p.add_argument("--stages", type=int, default=None,
                   help="equal stages instead of the automatic search")
    p.add_argument("--profile", action="store_true",
                   help="search stages on layer times measured on these ranks")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-plan", default=None, help="write the plan JSON here")
    return p.parse_args()


def main():
    args = parse_args()
    workload = zoo.tiny("gpt", batch_size=args.batch, num_layers=args.layers,
                        hidden=args.hidden, num_heads=4, max_seq_len=args.seq, dropout=0.0
                        ).replace(seq_len=args.seq)
    torch.manual_seed(0)
    model = workload.build()
    torch.manual_seed(0)
    reference = workload.build()                  # the same weights, on one device
    torch.manual_seed(1)
    batch = workload.example_inputs()             # (tokens, targets), the global batch

    method = torchalpa.PipeshardParallel(
        num_micro_batches=args.micro_batches, pipeline_schedule=args.schedule,
        layer_option=torchalpa.AutoLayerOption(layer_num=args.layers),
        stage_option=torchalpa.UniformStageOption(num_stages=args.stages) if args.stages
        else "profile" if args.profile else "auto")
    pmodel = torchalpa.auto_parallel(model, batch, workload.loss_fn, method=method,
                                     optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr))
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.stages:
        say(f"{args.stages} equal stages, as --stages asks: on a model this small over CPU "
            "ranks the stage search (without --stages) keeps one stage, since sending "
            "activations between stages costs more than splitting the layers saves; forcing "
            "them shows the pipeline at work.\n")
    say(pmodel.plan.summary())
    if args.save_plan and rank == 0:
        pmodel.plan.save(args.save_plan)

    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    say(f"\n{'step':>4} {'pipelined loss':>15} {'single-device':>15} {'rel diff':>9}")
    worst_loss = 0.0
    for step in range(args.steps):
        loss = pmodel.train_step(*batch).item()
        ref_loss = workload.loss_fn(reference(*batch[:-1]), batch[-1])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        rel = abs(loss - ref_loss.item()) / abs(ref_loss.item())
        worst_loss = max(worst_loss, rel)
        say(f"{step:>4} {loss:>15.6f} {ref_loss.item():>15.6f} {rel:>9.1e}")

    worst_param = torch.tensor(max_param_diff(pmodel, reference))
    dist.all_reduce(worst_param, op=dist.ReduceOp.MAX)
    say(f"after {args.steps} steps: loss rel diff <= {worst_loss:.1e}, parameters max |diff| "
        f"= {worst_param.item():.1e} against single-device training")
    ok = worst_loss < 1e-4 and worst_param.item() < 1e-4
    say("matches single-device training" if ok else "DOES NOT match single-device training")
    torchalpa.shutdown()   # leaves the group and exits now (ending without it is clean too)
    if not ok:
        raise SystemExit(1)


def max_param_diff(pmodel, reference) -> float:
    """Largest difference of the parameters this rank's stage holds, gathered over it."""
    worst, owner = 0.0, {}
    for s in pmodel.plan.stages:              # a tied weight belongs to its first stage
        for p in s.plan.parameters:
            owner.setdefault(p.name, s.ranks)
    mine = {name for name, ranks in owner.items() if dist.get_rank() in ranks}
    for (name, p), q in zip(pmodel.module.named_parameters(), reference.parameters()):
        if name in mine:
            worst = max(worst, (p.full_tensor() - q).abs().max().item())
    return worst


if __name__ == "__main__":
    main()
