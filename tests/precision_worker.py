"""Run on 4 gloo ranks by tests/test_zero1_precision.py: ZeRO-1 and reduced precision
trained beside one device. Scenarios (argv[2], ``name:method``, comma separated):

- ``zero1:fp32``: ``Zero1Parallel``, float32, 3 Adam steps; also the optimizer states'
  elements on this rank;
- ``bf16_reduce:dp|zero1``: ``MixedPrecision(bf16, reduce_dtype=bf16)``: float32 masters,
  bf16 compute, gradients summed in bf16; against the same policy's eager step on one
  device (3 SGD steps); also the bytes of every gradient reduction the plan lists;
- ``bf16_params:zero1``: the model itself in bf16 (parameters, gradients, SGD), against
  the bf16 model on one device;
- ``bf16_remat:zero1``: a tiny GPT whose every block casts its float32 weights to bf16
  (``CastForward`` per block, as Megatron's and DeepSpeed's per-module mixed precision),
  full activation checkpointing, 4 micro-batches (``block_remat_zero1``), against the
  same model on one device; also the bytes every step's all-gathers moved.

Rank 0 writes JSON to argv[1].
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from models import MLP, mlp_inputs  # noqa: E402
from worker_io import rel_to_scale, run_scenarios, train_beside_one_device  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.runtime.execution.precision import CastForward, MixedPrecision  # noqa: E402

# Adam moves every parameter by about lr whatever its gradient, so bf16's rounding of a
# tiny gradient can flip a step: plain SGD, whose step is the gradient, shows the
# gradients' bf16 error itself
BF16_SGD = dict(optimizer=torch.optim.SGD, lr=0.1)
METHODS = {"dp": torchalpa.DataParallel, "zero1": torchalpa.Zero1Parallel}


def _local_numel(t) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).numel()


def _train(method, *, dtype=torch.float32, policy=None, steps=3, optimizer=torch.optim.Adam,
           lr=1e-3) -> dict:
    torch.manual_seed(0)
    model = MLP(32, 3).to(dtype)
    torch.manual_seed(0)
    ref = MLP(32, 3).to(dtype)
    x, y = (t.to(dtype) for t in mlp_inputs(64, 32))
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, method=method,
                                 mixed_precision=policy,
                                 optimizer=lambda ps: optimizer(ps, lr=lr))
    ref_model = ref if policy is None else CastForward(ref, policy)
    run = train_beside_one_device(pm, ref_model, optimizer(ref.parameters(), lr=lr),
                                  lambda step: (x, y), F.mse_loss, steps=steps,
                                  backward_steps=range(steps))
    states = [v for s in pm.optimizer.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    reductions = [c for c in pm.plan.collectives
                  if c.kind in ("all_reduce", "reduce_scatter") and c.bytes > 4]
    return {"losses": run["losses"], "ref_losses": run["ref_losses"],
            "executed": run["executed"], "planned": run["planned"],
            "max_param_diff": max(d for d, _ in run["params"]),
            "max_param": max(s for _, s in run["params"]),
            "grad_diff_to_scale": [rel_to_scale(pairs) for pairs in run["grads"]],
            "kinds": sorted({c.kind for c in pm.plan.collectives}),
            "state_numel": sum(_local_numel(v) for v in states),
            "param_numel": sum(p.numel() for p in ref.parameters()),
            "grad_numel": sum(p.numel() for p in ref.parameters()),
            "reduced_bytes": sum(c.bytes for c in reductions) * (
                4 if any(c.kind == "reduce_scatter" for c in reductions) else 1),
            "param_dtypes": sorted({str(p.dtype) for p in pm.parameters()})}


def block_remat_zero1(model) -> tuple:
    """(method, the model with each block and top-level module computing in bf16): ZeRO-1
    with 4 micro-batches and full activation checkpointing."""
    from dataclasses import replace
    inner = MixedPrecision(param_dtype=torch.bfloat16, output_dtype=None)
    head = MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    for i, block in enumerate(model.h):
        model.h[i] = CastForward(block, inner)
    children = [name for name, m in model.named_children()
                if m is not model.h and any(True for _ in m.parameters())]
    for name in children:       # the last (the tied head) casts its logits back up
        setattr(model, name, CastForward(getattr(model, name),
                                         head if name == children[-1] else inner))
    option = replace(torchalpa.Zero1Parallel().auto_sharding_option, remat="full")
    return torchalpa.Zero1Parallel(num_micro_batches=4, auto_sharding_option=option), model


def _bf16_remat() -> dict:
    import torchalpa.models as zoo
    gpt = zoo.tiny("gpt", batch_size=16, dropout=0.0, num_layers=2)
    torch.manual_seed(1234)
    batch = gpt.example_inputs()
    torch.manual_seed(0)
    method, model = block_remat_zero1(gpt.build())
    torch.manual_seed(0)
    _, ref = block_remat_zero1(gpt.build())
    pm = torchalpa.auto_parallel(model, batch, gpt.loss_fn, method=method,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    run = train_beside_one_device(pm, ref, torch.optim.SGD(ref.parameters(), lr=0.1),
                                  lambda step: batch, gpt.loss_fn, steps=3,
                                  backward_steps=())
    return {"losses": run["losses"], "ref_losses": run["ref_losses"],
            "executed": run["executed"], "planned": run["planned"],
            "max_param_diff": max(d for d, _ in run["params"]),
            "max_param": max(s for _, s in run["params"]),
            "gathered_bytes": [sum(b for k, _, b in step if k == "all_gather")
                               for step in run["executed"]],
            "param_numel": sum(p.numel() for p in ref.parameters()),
            "remat": pm.plan.method.get("remat")}


def run(name: str, method: str) -> dict:
    make = METHODS.get(method, torchalpa.Zero1Parallel)
    if name == "zero1":
        return _train(make())
    if name == "bf16_reduce":
        return _train(make(), policy=MixedPrecision(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.bfloat16), **BF16_SGD)
    if name == "bf16_params":
        return _train(make(), dtype=torch.bfloat16, **BF16_SGD)
    if name == "bf16_remat":
        return _bf16_remat()
    raise ValueError(f"unknown scenario {name!r}")


def main():
    run_scenarios(run)


if __name__ == "__main__":
    main()
