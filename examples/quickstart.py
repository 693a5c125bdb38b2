"""Alpa's quickstart in PyTorch: an MLP trained with torchalpa on every torchrun rank.

    torchrun --nproc_per_node=4 examples/quickstart.py                 # default size
    torchrun --nproc_per_node=4 examples/quickstart.py --dim 1024 --batch 1024 --layers 10
    torchrun --nproc_per_node=4 examples/quickstart.py --compare ddp fsdp2

Every rank builds the same model from the same seed and passes the same global batch;
torchalpa plans on rank 0, shards the parameters, and each rank runs its part of the step.
The script checks the parameters after one step against single-device training (Alpa's
quickstart tolerance, atol 5e-3), then trains, and prints per-rank model-state bytes and
step time (next to DDP / FSDP2 with --compare).
"""

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
from torchalpa.runtime.measurement.measure import model_state_bytes, timed_steps


class MLP(nn.Module):
    """Alpa's quickstart model: num_layers Linear layers, d -> 4d on even ones, 4d -> d on
    odd ones, a ReLU after each."""

    def __init__(self, dim: int, num_layers: int):
        super().__init__()
        layers = []
        for i in range(num_layers):
            layers.append(nn.Linear(dim, 4 * dim) if i % 2 == 0 else nn.Linear(4 * dim, dim))
            layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x):            # (B, d) -> (B, d) or (B, 4d)
        return self.net(x)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", nargs="*", default=[], choices=["ddp", "fsdp2"],
                   help="also train these hand-written baselines in the same run")
    p.add_argument("--save-plan", default=None, help="write the plan JSON here")
    p.add_argument("--json", default=None, help="write the measured figures here (rank 0)")
    return p.parse_args()


def make_model(args) -> nn.Module:
    torch.manual_seed(args.seed)
    return MLP(args.dim, args.layers)


def make_batch(args):
    g = torch.Generator().manual_seed(args.seed + 1)
    out_dim = 4 * args.dim if args.layers % 2 else args.dim
    x = torch.randn(args.batch, args.dim, generator=g)        # (B, d)
    y = torch.randn(args.batch, out_dim, generator=g)         # (B, d_out)
    return x, y


def check_one_step_against_single_device(args, pmodel, opt, x, y) -> float:
    """Train one step both ways; the largest parameter difference (all ranks agree)."""
    ref = make_model(args)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=args.lr)
    F.mse_loss(ref(x), y).backward()
    ref_opt.step()

    loss = pmodel(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    worst = 0.0
    for (name, p), q in zip(pmodel.module.named_parameters(), ref.parameters()):
        full = p.full_tensor()
        assert torch.allclose(full, q, atol=5e-3), f"{name} differs from single-device training"
        worst = max(worst, (full - q).abs().max().item())
    return worst


def main():
    args = parse_args()
    x, y = make_batch(args)
    model = make_model(args)
    pmodel = torchalpa.auto_parallel(model, (x, y), loss_fn=F.mse_loss)
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(pmodel.plan.summary())
    if args.save_plan and rank == 0:
        pmodel.plan.save(args.save_plan)

    opt = torch.optim.Adam(pmodel.parameters(), lr=args.lr)
    worst = check_one_step_against_single_device(args, pmodel, opt, x, y)
    say(f"\nafter 1 step, parameters match single-device training: max |diff| = {worst:.2e} "
        "(atol 5e-3)")

    def step():
        opt.zero_grad(set_to_none=True)
        loss = pmodel(x, y)
        loss.backward()
        opt.step()
        step.loss = loss.item()

    stats = {"torchalpa": timed_steps(step, max(args.steps - 1, 1))}
    stats["torchalpa"]["state"] = model_state_bytes(pmodel.parameters(), opt)
    say(f"loss after {args.steps} steps: {step.loss:.6f}")
    for name in args.compare:
        stats[name] = run_baseline(name, args, x, y)

    say(f"\n{'method':<10} {'model state / rank':>20} {'step time':>12} {'loopback / step':>18}")
    for name, s in stats.items():
        say(f"{name:<10} {s['state'] / 2**20:>17.1f} MiB {s['step_s'] * 1e3:>9.1f} ms "
            f"{s['loopback_bytes_per_step'] / 2**20:>14.1f} MiB")
    say("(loopback bytes are exact only inside shared/tools/netns_bytes.sh)")
    if args.json and rank == 0:
        stats["torchalpa"]["planned_wire_bytes_per_step"] = pmodel.plan.estimates["wire_bytes_per_step"]
        stats["torchalpa"]["max_param_diff_after_1_step"] = worst
        stats["torchalpa"]["final_loss"] = step.loss
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "world_size": dist.get_world_size(), "stats": stats},
                      f, indent=1)
    torchalpa.shutdown()   # leaves the group and exits now (ending without it is clean too)


def run_baseline(name, args, x, y) -> dict:
    from torchalpa.runtime.measurement.baselines import batch_shard, wrap_ddp, wrap_fsdp2
    model = make_model(args)
    model = wrap_ddp(model) if name == "ddp" else wrap_fsdp2(model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    rank, world = dist.get_rank(), dist.get_world_size()
    xs, ys = batch_shard(x, rank, world), batch_shard(y, rank, world)

    def step():
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(xs), ys).backward()
        opt.step()

    stats = timed_steps(step, max(args.steps - 1, 1))
    stats["state"] = model_state_bytes(model.parameters(), opt)
    return stats


if __name__ == "__main__":
    main()
