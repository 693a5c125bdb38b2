"""The README's loop and ``train_step`` under ``DataParallel`` on gloo ranks, looking at the
gradient buckets (tests/test_kept_buckets.py): a bucket's flat buffer is kept from step to
step (the gradients' storage is the same buffer each step), yet a gradient the user keeps
is never overwritten, gradients accumulate over two backward calls as on one device, and
a second backward of the same loss is refused with a clear error.

Scenario ``loop:0``: a 6-layer MLP with biases (every gradient in one of two buckets),
four steps of ``loss = pm(x, y); loss.backward(); opt.step(); opt.zero_grad()`` beside the
same steps on one device; then a step whose gradients the user keeps, one with
``zero_grad(set_to_none=False)`` and two backward calls, ``torch.autograd.grad``,
``backward(inputs=)``, a parameter's hook, and a second backward.
Scenario ``train_step:0``: four ``train_step`` calls; the gradients' storage each step.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from worker_io import run_scenarios  # noqa: E402

import torchalpa  # noqa: E402

WIDTH = 32


def model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g)


def storages(pm) -> list[int]:
    """The data pointer of each gradient's storage (its bucket's buffer, when bucketed)."""
    return [p.grad._local_tensor.untyped_storage().data_ptr() for p in pm.parameters()]


def max_diff(pm, ref: nn.Module) -> float:
    return max((p.grad.full_tensor() - r.grad).abs().max().item()
               for p, r in zip(pm.parameters(), ref.parameters()))


def wrap(optimizer=True):
    x, y = batch(0)
    return torchalpa.auto_parallel(
        model(), (x, y), F.mse_loss, method=torchalpa.DataParallel(),
        optimizer=(lambda ps: torch.optim.SGD(ps, lr=0.1)) if optimizer else None)


def loop() -> dict:
    pm, ref = wrap(), model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    out: dict = {"storages": [], "grad_diff": [], "buckets": 0}
    for step in range(4):
        x, y = batch(step)
        pm(x, y).backward()
        F.mse_loss(ref(x), y).backward()
        out["storages"].append(storages(pm))
        out["grad_diff"].append(max_diff(pm, ref))
        pm.optimizer.step()
        pm.optimizer.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    out["distinct_storages"] = len(set(out["storages"][-1]))
    # gradients the user keeps (a reference, not a copy) are not overwritten by the next step
    x, y = batch(10)
    pm(x, y).backward()
    kept = [p.grad for p in pm.parameters()]
    copies = [g.full_tensor().clone() for g in kept]
    pm.optimizer.zero_grad()
    pm(*batch(11)).backward()
    out["kept_unchanged"] = all(torch.equal(g.full_tensor(), c) for g, c in zip(kept, copies))
    out["kept_storage_reused"] = bool(
        {g._local_tensor.untyped_storage().data_ptr() for g in kept} & set(storages(pm)))
    del kept
    # two backward calls without zero_grad: the sum, as on one device
    pm.optimizer.zero_grad(set_to_none=False)
    ref_opt.zero_grad(set_to_none=False)
    for step in (12, 13):
        x, y = batch(step)
        pm(x, y).backward()
        F.mse_loss(ref(x), y).backward()
    out["accumulated_diff"] = max_diff(pm, ref)
    for _ in range(2):     # and again, the gradients still held from before (not set to None)
        pm.optimizer.zero_grad(set_to_none=False)
        ref_opt.zero_grad(set_to_none=False)
        x, y = batch(14)
        pm(x, y).backward()
        F.mse_loss(ref(x), y).backward()
        out["accumulated_diff"] = max(out["accumulated_diff"], max_diff(pm, ref))
    # torch.autograd.grad and backward(inputs=) get their gradients; a hook still fires
    pm.optimizer.zero_grad()
    x, y = batch(16)
    params = list(pm.parameters())
    grads = torch.autograd.grad(pm(x, y), params)
    ref_grads = torch.autograd.grad(F.mse_loss(ref(x), y), list(ref.parameters()))
    out["autograd_grad_diff"] = max((g.full_tensor() - r).abs().max().item()
                                    for g, r in zip(grads, ref_grads))
    out["autograd_grad_set_none"] = all(p.grad is None for p in params)
    pm(x, y).backward(inputs=[params[0]])
    out["inputs_only"] = params[0].grad is not None and all(p.grad is None for p in params[1:])
    pm.optimizer.zero_grad()
    fired: list = []
    handle = params[1].register_post_accumulate_grad_hook(lambda p: fired.append(p.grad))
    pm(x, y).backward()
    handle.remove()
    out["hook_fired"] = len(fired) == 1 and fired[0] is params[1].grad
    loss = pm(*batch(15))
    loss.backward(retain_graph=True)
    try:
        loss.backward()
        out["second_backward"] = None
    except RuntimeError as e:
        out["second_backward"] = str(e)
    return out


def train_step() -> dict:
    pm = wrap()
    seen = []
    for step in range(4):
        pm.train_step(*batch(step))
        seen.append(storages(pm))
    return {"storages": seen}


def run(name: str, arg: str) -> dict:
    del arg
    return {"loop": loop, "train_step": train_step}[name]()


def main() -> None:
    run_scenarios(run)


if __name__ == "__main__":
    main()
