"""Run on the rank pool by tests/test_layer_remat_offload.py: training on 2 gloo ranks with
plans only an expert would write by hand -- some blocks checkpointed ('full:k', chosen by
AutoParallel under a tight budget) and optimizer states offloaded to host copies --
against plain training of the same model on one device. Rank 0 writes JSON."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from worker_io import run_listed_scenarios, train_beside_one_device  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402
from torchalpa.runtime.execution.host_optimizer import HOST_PAIRS  # noqa: E402

BUDGET = 1.38e6
"""Bytes per device between what checkpointing every block and none need (tiny GPT, 4
blocks, parameters replicated on 2 ranks: about 1.23 and 1.53 MB)."""


def train(gpt, batch, method, steps: int = 3, watch=None) -> dict:
    """``method``'s plan trained ``steps`` AdamW steps beside the model on this process."""
    torch.manual_seed(0)
    model = gpt.build()
    torch.manual_seed(0)
    ref = gpt.build()
    pm = torchalpa.auto_parallel(model, batch, gpt.loss_fn, method=method,
                                 cluster=torchalpa.Cluster.local_cpu(2),
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    run = train_beside_one_device(pm, ref, ref_opt, lambda _: batch, gpt.loss_fn, steps=steps,
                                  backward_steps=())
    out = {"remat": pm.plan.method.get("remat"), "offload": bool(pm.plan.method.get("offload")),
           "notes": list(pm.plan.notes), "estimates": pm.plan.estimates.to_dict(),
           "losses": run["losses"], "ref_losses": run["ref_losses"],
           "max_param_diff": max(d for d, _ in run["params"])}
    pairs = getattr(pm.optimizer, HOST_PAIRS, [])
    device = {t.to_local().data_ptr() for t in pm.module.parameters()}
    out["host_copies"] = len(pairs)
    out["states_apart"] = bool(pairs) and all(
        v.data_ptr() not in device for s in pm.optimizer.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim()) and all(
        h.data_ptr() not in device for _, h in pairs)
    out["device_grads_left"] = sum(p.grad is not None for p in pm.module.parameters())
    if watch is not None:
        watch(pm)
    return out


def scenarios(n):
    gpt = zoo.tiny("gpt", batch_size=8, dropout=0.0, num_layers=4)
    torch.manual_seed(1234)                 # the same global batch on every rank
    batch = gpt.example_inputs()
    if n == 4:       # a pipeline whose first stage checkpoints its blocks, the second not
        from pipeline_worker import compare, manual
        method = torchalpa.PipeshardParallel(
            num_micro_batches=4, layer_option=torchalpa.AutoLayerOption(layer_num=2),
            stage_option=manual([[0], [1]], [(1, 2), (1, 2)]),
            auto_sharding_option=torchalpa.AutoShardingOption(remat="full:2"))
        yield "pipeline_layers", lambda: compare(gpt.build, batch, gpt.loss_fn, method,
                                                 cluster=torchalpa.Cluster.local_cpu(4))
        return
    fixed = dict(pipeline=False, num_micro_batches=1, rematerialize_parameters=False)
    tight = torchalpa.AutoShardingOption(parameters="replicated",
                                         memory_budget_per_device=BUDGET)
    yield "layers", lambda: train(gpt, batch, torchalpa.AutoParallel(
        remat=("none", "full", "layers"), auto_sharding_option=tight, **fixed))
    yield "offload", lambda: train(gpt, batch, torchalpa.AutoParallel(
        remat=("none",), offload=True, **fixed))
    yield "plain_2", lambda: train(gpt, batch, torchalpa.AutoParallel(   # param_offload_2's
        remat=("none",), offload=False, pipeline=False, num_micro_batches=2,   # twin on the
        rematerialize_parameters=True))                                        # devices
    for k in (1, 2):          # parameters streamed from host memory, gradients back
        yield f"param_offload_{k}", lambda k=k: streamed(gpt, batch, torchalpa.AutoParallel(
            remat=("none",), offload="parameters", pipeline=False, num_micro_batches=k))
    for offload in (True, "parameters"):    # a host optimizer saved, resumed to the bit
        yield f"checkpoint_{offload}", lambda o=offload: resumed(gpt, batch, o)


def resumed(gpt, batch, offload, steps: int = 4, at: int = 2) -> dict:
    """Train ``steps`` steps saving a checkpoint before step ``at``; a fresh run (other
    initial weights) loads it and trains the rest: the losses and weights of both."""
    from torchalpa.runtime.state.checkpoint import load_checkpoint, save_checkpoint
    path = os.path.join(os.path.dirname(sys.argv[1]), f"ckpt_offload_{offload}")
    method = torchalpa.AutoParallel(remat=("none",), offload=offload, pipeline=False,
                                    num_micro_batches=1)

    def wrap(seed):
        torch.manual_seed(seed)
        return torchalpa.auto_parallel(gpt.build(), batch, gpt.loss_fn, method=method,
                                       cluster=torchalpa.Cluster.local_cpu(2),
                                       optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    pm = wrap(0)
    out = {"uninterrupted": [], "offload_parameters": bool(pm.plan.method.get(
        "offload_parameters"))}
    for step in range(steps):
        if step == at:
            save_checkpoint(path, pm)
        out["uninterrupted"].append(pm.train_step(*batch).item())
    fresh = wrap(123)
    load_checkpoint(path, fresh)
    out["resumed"] = [fresh.train_step(*batch).item() for _ in range(at, steps)]
    out["same_weights"] = all(torch.equal(p.to_local(), q.to_local()) for p, q in
                              zip(pm.module.parameters(), fresh.module.parameters()))
    return out


def streamed(gpt, batch, method) -> dict:
    """``train`` with parameters offloaded, and what shows they were: the programs read
    device copies and send gradients to the host, the optimizer steps the blocks in place."""
    out = {}

    def watch(pm):
        code = pm.local_program()
        out["fetches"] = code.count("fetch(")
        out["grads_to_host"] = code.count("to_host(")
        out["offload_parameters"] = bool(pm.plan.method.get("offload_parameters"))
        local = {p.to_local().data_ptr() for p in pm.module.parameters()}
        out["stepped_in_place"] = {h.data_ptr() for _, h in getattr(pm.optimizer, HOST_PAIRS)
                                   } == local
    out.update(train(gpt, batch, method, watch=watch))
    return out


def main():
    run_listed_scenarios(scenarios)


if __name__ == "__main__":
    main()
