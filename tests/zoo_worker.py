"""Run under torchrun by tests/test_zoo.py: every zoo model family trains with torchalpa
and on a single device from the same weights and batch; rank 0 writes what both saw.

argv: output path, mesh ("1d", "2x2", "2x4"), comma-separated families.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402
from torchalpa.runtime.buckets import issued_collectives  # noqa: E402
from torchalpa.runtime.comm_count import CollectiveCounter  # noqa: E402
from torchalpa.runtime.mesh import init_distributed  # noqa: E402
from worker_io import attempt, finish  # noqa: E402

STEPS = 5


def run(family: str, mesh_shape) -> dict:
    workload = zoo.tiny(family, batch_size=8)
    torch.manual_seed(1234)                      # the same global batch on every rank
    batch = workload.example_inputs()
    torch.manual_seed(0)
    model = workload.build()
    torch.manual_seed(0)
    ref = workload.build()
    # compared with one device step by step: dropout masks drawn whole, as it draws them
    method = torchalpa.ShardParallel(logical_mesh_shape=mesh_shape, auto_sharding_option=(
        torchalpa.AutoShardingOption(random="replicated")))
    pm = torchalpa.auto_parallel(model, batch, workload.loss_fn, method=method,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    predicted = sorted([c.kind, c.axis, c.bytes] for c in issued_collectives(pm.plan))
    out = {"losses": [], "ref_losses": [], "executed_equal_predicted": [],
           "num_collectives": len(predicted), "mesh": list(pm.plan.mesh_shape),
           "unsupported": sorted({u["op"] for u in pm.plan.unsupported_ops}),
           "sharded_params": sum(any(str(p) != "R" for p in v.placements)
                                 for v in pm.plan.parameters)}
    for step in range(STEPS):
        torch.manual_seed(7 + step)                 # dropout draws the same on both sides
        with CollectiveCounter.for_mesh(pm.mesh) as counter:
            if step == 0:                           # the loss.backward() path, grads compared
                loss = pm(*batch)
                loss.backward()
            else:
                loss = pm.train_step(*batch)
        executed = sorted([r.kind, r.axis, r.bytes] for r in counter.records)
        out["executed_equal_predicted"].append(executed == predicted)
        torch.manual_seed(7 + step)
        ref_loss = workload.loss_fn(ref(*batch[:-1]), batch[-1])
        ref_loss.backward()
        if step == 0:
            # relative to the model's gradient scale: some gradients are exactly zero in
            # exact arithmetic (an attention key bias: softmax ignores a shift) and both
            # sides hold float noise there
            pairs = [(p.grad.full_tensor(), q.grad) for p, q in
                     zip(pm.module.parameters(), ref.parameters()) if q.grad is not None]
            scale = max(q.abs().max().item() for _, q in pairs)
            out["max_rel_grad_diff"] = max((g - q).abs().max().item() for g, q in pairs) / scale
            pm.optimizer.step()
            pm.optimizer.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
        out["ref_losses"].append(ref_loss.item())
    out["max_param_diff"] = max((p.full_tensor() - q).abs().max().item()
                                for p, q in zip(pm.module.parameters(), ref.parameters()))
    return out


def main():
    out_path, mesh, families = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    init_distributed()
    n = dist.get_world_size()
    shape = (n,) if mesh == "1d" else tuple(int(s) for s in mesh.split("x"))
    results = {"world_size": n}
    for family in families:
        results[family] = attempt(lambda: run(family, shape))
    finish(results, out_path)


if __name__ == "__main__":
    main()
