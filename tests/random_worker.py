"""Run under torchrun by tests/test_random.py: dropout on real gloo ranks. Rank 0 writes
what it saw as JSON to argv[1]; argv[2] lists the scenarios.

Replicas are compared by gathering every rank's blocks (not with torchalpa's own replica
check, which one scenario tests).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: E402
from worker_io import attempt, finish  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.core.options import AutoShardingOption  # noqa: E402
from torchalpa.runtime.execution.mesh import init_distributed  # noqa: E402
from torchalpa.runtime.lowering.random_draws import RandomStateWarning  # noqa: E402
from torchalpa.runtime.resilience.replicas import RNG_STATE, ReplicaMismatchError  # noqa: E402

DIM, BATCH = 32, 64


class DropoutMLP(nn.Module):
    """A transformer MLP block with dropout after the activation and on the output."""

    def __init__(self, p: float = 0.1):
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


def adam(ps):
    return torch.optim.Adam(ps, lr=1e-2)


def wrap(model, **kw):
    kw.setdefault("method", torchalpa.ShardParallel())
    return torchalpa.auto_parallel(model, batch(0), F.mse_loss, optimizer=adam, **kw)


def replica_diffs(pm) -> dict:
    """Per parameter: the largest difference between copies of the same block on
    different ranks (0.0 when every replica is bitwise equal), over all ranks."""
    mine = {}
    for name, p in pm.module.named_parameters():
        block = tuple(c if p.placements[a].is_shard() else 0
                      for a, c in enumerate(pm.mesh.get_coordinate()))
        mine[name] = (block, p.to_local().detach().clone())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    diffs = {}
    for name in mine:
        first: dict = {}
        worst = 0.0
        for rank_blocks in everyone:
            block, value = rank_blocks[name]
            ref = first.setdefault(block, value)
            worst = max(worst, (value - ref).abs().max().item())
        diffs[name] = worst
    return diffs


def dropout_placements(pm) -> list[str]:
    from torchalpa.core.placement import format_placements
    return [f"({', '.join(format_placements(s.outputs[0]))},)" for s in pm.plan.strategies
            if "dropout" in s.node and "backward" not in s.node]


# -- scenarios ----------------------------------------------------------------------------

def per_rank_seeds(**kw):
    """The DDP habit: every rank seeds itself differently before wrapping. Replicas must
    stay bitwise equal after 3 steps with dropout."""
    torch.manual_seed(dist.get_rank())
    model = DropoutMLP()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = wrap(model, **kw)
    losses = [pm.train_step(*batch(step)).item() for step in range(3)]
    return {"warned": any(issubclass(w.category, RandomStateWarning) for w in caught),
            "losses": losses, "replica_diffs": replica_diffs(pm),
            "dropout_placements": dropout_placements(pm), "mesh": list(pm.plan.mesh_shape)}


def detects_drift():
    """check_replicas=True: a random call on one rank only after wrapping, and a replica
    changed on one rank, are errors naming what differs, raised on every rank."""
    torch.manual_seed(0)
    pm = wrap(DropoutMLP(), method=torchalpa.DataParallel(), check_replicas=True)
    out = {"first_step": pm.train_step(*batch(0)).item()}
    if dist.get_rank() == 1:
        torch.rand(3)                          # e.g. an augmentation drawn on rank 1 only
    try:
        pm.train_step(*batch(1))
        out["rng_error"] = None
    except ReplicaMismatchError as e:
        out["rng_error"] = str(e)
    torch.manual_seed(0)                       # agree again, then corrupt a replica
    if dist.get_rank() == 2:
        with torch.no_grad():
            pm.module.fc2.bias.to_local()[0] += 1e-6
    try:
        pm.check_replicas()
        out["param_error"] = None
    except ReplicaMismatchError as e:
        out["param_error"] = str(e)
    out["rng_name"] = RNG_STATE
    return out


def reproducible():
    """The same seed gives the same losses; the default generator state (saved after a
    step and restored with the weights and optimizer) resumes bit-identically."""
    def run(seed, steps=3):
        torch.manual_seed(0)
        pm = wrap(DropoutMLP(), method=torchalpa.DataParallel())
        torch.manual_seed(seed)
        return pm, [pm.train_step(*batch(s)).item() for s in range(steps)]

    _, first = run(5)
    pm, second = run(5, steps=1)
    saved = {"rng": torch.get_rng_state(),
             "params": {n: p.to_local().detach().clone() for n, p in pm.module.named_parameters()},
             "optim": _clone_state(pm.optimizer.state_dict())}
    second += [pm.train_step(*batch(s)).item() for s in (1, 2)]
    torch.manual_seed(99)                      # anything in between
    with torch.no_grad():
        for n, p in pm.module.named_parameters():
            p.to_local().copy_(saved["params"][n])
    pm.optimizer.load_state_dict(saved["optim"])
    torch.set_rng_state(saved["rng"])
    resumed = [pm.train_step(*batch(s)).item() for s in (1, 2)]
    _, other = run(6)
    return {"first": first, "second": second, "resumed": resumed, "other_seed": other}


def _clone_state(state):
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)


def random_replicated():
    """random="replicated": masks drawn whole, as one device draws them -- the loss equals
    single-device training up to summation order; the default (sharded) draws others."""
    def losses(option):
        torch.manual_seed(0)
        method = torchalpa.DataParallel(auto_sharding_option=AutoShardingOption(
            force_batch_dim_to_mesh_dim=-1, parameters="replicated", random=option))
        pm = wrap(DropoutMLP(), method=method)
        torch.manual_seed(7)
        return [pm.train_step(*batch(s)).item() for s in range(3)], dropout_placements(pm)

    torch.manual_seed(0)
    ref = DropoutMLP()
    opt = adam(ref.parameters())
    torch.manual_seed(7)
    ref_losses = []
    for s in range(3):
        opt.zero_grad()
        loss = F.mse_loss(ref(batch(s)[0]), batch(s)[1])
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    replicated, rep_placements = losses("replicated")
    sharded, sh_placements = losses("sharded")
    return {"ref": ref_losses, "replicated": replicated, "sharded": sharded,
            "replicated_placements": rep_placements, "sharded_placements": sh_placements}


SCENARIOS = {
    "per_rank_seeds": lambda: per_rank_seeds(method=torchalpa.DataParallel()),
    # Megatron's MLP pinned on the last axis, so the second dropout draws on values
    # replicated over it (left to the ILP, equal-cost plans without such a dropout were
    # returned in some launches: docs/troubleshooting.md, "Two launches planned differently")
    "per_rank_seeds_2d": lambda: per_rank_seeds(
        method=torchalpa.ShardParallel(logical_mesh_shape=(2, 2), auto_sharding_option=(
            AutoShardingOption(pin={"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})))),
    "detects_drift": detects_drift,
    "reproducible": reproducible,
    "random_replicated": random_replicated,
}


def main():
    out_path, which = sys.argv[1], sys.argv[2].split(",")
    init_distributed()
    results: dict = {"world_size": dist.get_world_size()}
    for name in which:
        results[name] = attempt(SCENARIOS[name])
    finish(results, out_path)


if __name__ == "__main__":
    main()
