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

from worker_io import attempt, finish, rel_to_scale, train_beside_one_device  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402
from torchalpa.runtime.execution.mesh import init_distributed  # noqa: E402
from torchalpa.runtime.measurement.issued import issued_collectives  # noqa: E402

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
    predicted = sorted([c.kind, c.axis, c.bytes] for c in issued_collectives(pm.plan))
    # dropout draws the same on both sides: torch seeded alike before each side of a step
    trained = train_beside_one_device(pm, ref, torch.optim.AdamW(ref.parameters(), lr=1e-3),
                                      lambda step: batch, workload.loss_fn, steps=STEPS,
                                      seed_of_step=lambda step: 7 + step)
    return {"losses": trained["losses"], "ref_losses": trained["ref_losses"],
            # step 0 by loss.backward(), the others by train_step (the loss may ride a bucket)
            "executed_equal_predicted": [e == p for e, p in zip(trained["executed"],
                                                                trained["planned"])]
            + [trained["planned"][0] == predicted],
            "num_collectives": len(predicted), "mesh": list(pm.plan.mesh_shape),
            "unsupported": sorted({u["op"] for u in pm.plan.unsupported_ops}),
            "sharded_params": sum(any(str(p) != "R" for p in v.placements)
                                  for v in pm.plan.parameters),
            # relative to the model's gradient scale: some gradients are exactly zero in
            # exact arithmetic (an attention key bias: softmax ignores a shift) and both
            # sides hold float noise there
            "max_rel_grad_diff": rel_to_scale(trained["grads"][0]),
            "max_param_diff": max(d for d, _ in trained["params"])}


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
