"""Run on 4 gloo ranks by tests/test_moe_2d_reshard.py: Alpa's MoE layer (BERT attention,
top-2 gated experts) on a (2, 2) mesh in Alpa's layout for test_moe_layer_2d -- tokens
split over both axes, experts over the inner one, no all-gather allowed -- trained next to
the same model on one device. The tokens reach the experts by all-to-alls on the inner axis
of a dim split over both (passes/sharding/reshard.py, ``_all_to_all_direct``). Rank 0 writes what
it saw as JSON to argv[1]: losses, gradients and parameters on both sides, the collectives
each step issued next to the plan's, and the plan's all-to-alls out of a two-axis split."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from alpa_cases import MoELayer, mse  # noqa: E402
from worker_io import attempt, finish, max_rel, train_beside_one_device  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.core.placement import Replicate, Shard  # noqa: E402
from torchalpa.runtime.execution.mesh import init_distributed  # noqa: E402
from torchalpa.runtime.measurement.issued import issued_collectives  # noqa: E402

HIDDEN, HEADS, GROUP, EXPERTS, BATCH, SEQ = 16, 4, 8, 8, 8, 8


def batch(step: int):
    g = torch.Generator().manual_seed(300 + step)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.2).float()
    return (torch.randn(BATCH, SEQ, HIDDEN, generator=g), mask,
            torch.randn(BATCH, SEQ, HIDDEN, generator=g))


def alpa_layout() -> tuple:
    R = Replicate()
    return ((r"attention\..*", (R, R)), (r"norm\..*", (R, R)), (r"moe\.wg", (R, R)),
            (r"moe\.w[io]", (R, Shard(0))), (r"(?!attention|moe|norm).*", (Shard(0), Shard(0))))


def nested_all_to_alls(plan) -> int:
    """All-to-all steps whose source dim is split over both mesh axes."""
    found = 0
    for r in plan.reshards:
        for s in r.steps:
            if s.kind == "all_to_all" and sum(isinstance(p, Shard) and p.dim == s.src_dim
                                              for p in s.src) == 2:
                found += 1
    return found


def moe_2d() -> dict:
    torch.manual_seed(0)
    model = MoELayer(HIDDEN, HEADS, GROUP, EXPERTS)
    torch.manual_seed(0)
    ref = MoELayer(HIDDEN, HEADS, GROUP, EXPERTS)
    shape = (2, 2)
    option = torchalpa.AutoShardingOption(allow_mixed_mesh_shape=True, allow_all_gather=False,
                                          allow_reduce_scatter=False, pin=alpa_layout())
    pm = torchalpa.auto_parallel(
        model, batch(0), mse, cluster=torchalpa.LogicalMesh(shape=shape),
        method=torchalpa.ShardParallel(logical_mesh_shape=shape, auto_sharding_option=option),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    run = train_beside_one_device(pm, ref, torch.optim.SGD(ref.parameters(), lr=0.1),
                                  batch, mse, steps=3)
    return {"planned": sorted([c.kind, c.axis, c.bytes] for c in issued_collectives(pm.plan)),
            "nested_all_to_alls": nested_all_to_alls(pm.plan),
            "executed": run["executed"], "planned_per_step": run["planned"],
            "losses": run["losses"],
            "ref_losses": run["ref_losses"], "grad_rel_diff": max_rel(run["grads"][0]),
            "param_rel_diff": max_rel(run["params"])}


def main():
    out_path = sys.argv[1]
    init_distributed()
    results: dict = {"world_size": dist.get_world_size(), "moe_2d": attempt(moe_2d)}
    finish(results, out_path)


if __name__ == "__main__":
    main()
