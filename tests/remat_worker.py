"""Run on the rank pool by tests/test_checkpoint.py: training with activation checkpointing
(remat="full") against plain training of the same model on one device, intra-op on 2
ranks and pipelined on 4. Rank 0 writes JSON."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from pipeline_worker import compare, manual  # noqa: E402
from worker_io import run_listed_scenarios, train_beside_one_device  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402


def intra_op(gpt, batch, remat: str, steps: int = 3) -> dict:
    """ShardParallel with ``remat``: losses and parameters after ``steps`` Adam steps,
    against the model trained on this process alone."""
    torch.manual_seed(0)
    model = gpt.build()
    torch.manual_seed(0)
    ref = gpt.build()
    option = torchalpa.AutoShardingOption(remat=remat)
    pm = torchalpa.auto_parallel(model, batch, gpt.loss_fn,
                                 method=torchalpa.ShardParallel(auto_sharding_option=option),
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    run = train_beside_one_device(pm, ref, ref_opt, lambda _: batch, gpt.loss_fn, steps=steps,
                                  backward_steps=())
    return {"losses": run["losses"], "ref_losses": run["ref_losses"],
            "max_param_diff": max(d for d, _ in run["params"]),
            "remat": pm.plan.method.get("remat"), "notes": list(pm.plan.notes)}


def scenarios(n):
    gpt = zoo.tiny("gpt", batch_size=8, dropout=0.0, num_layers=4)
    torch.manual_seed(1234)                 # the same global batch on every rank
    batch = gpt.example_inputs()
    if n == 2:
        for remat in ("full", "none"):
            yield f"intra_{remat}", lambda remat=remat: intra_op(gpt, batch, remat)
    if n == 4:
        P, L = torchalpa.PipeshardParallel, torchalpa.AutoLayerOption
        option = torchalpa.AutoShardingOption(remat="full")

        def pipeline():
            method = P(num_micro_batches=4, layer_option=L(layer_num=2),
                       stage_option=manual([[0], [1]], [(1, 2), (1, 2)]),
                       auto_sharding_option=option)
            # the plan's remat setting and notes come with compare's results (pm.plan):
            # planning the same model again to read them cost a capture and a solve
            return compare(gpt.build, batch, gpt.loss_fn, method,
                           cluster=torchalpa.Cluster.local_cpu(4))
        yield "pipeline_full", pipeline


def main():
    run_listed_scenarios(scenarios)


if __name__ == "__main__":
    main()
