"""Run under torchrun by tests/test_suite.py: cases of ``torchalpa.suite.cases`` train
3 AdamW steps with torchalpa and on one device from the same weights and batch.

The first step goes through the module call and ``loss.backward()`` (called as the
model's docs call it: keyword batches return the model's output object), the others
through ``train_step``. Rank 0 writes per case: both loss curves, the largest parameter
difference, whether every rank holds bitwise the same block of each replicated value
(parameters, buffers, the loss), and the ops planned without a sharding rule.

argv: output path, comma-separated case names.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

sys.path.insert(0, os.path.dirname(__file__))

from worker_io import attempt, finish  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.runtime.execution.mesh import init_distributed  # noqa: E402
from torchalpa.runtime.lowering.strided_dtensor import full_value  # noqa: E402
from torchalpa.suite.cases import build_case  # noqa: E402

STEPS = 3
LR = 1e-3


def call(model, batch, loss_fn):
    """The loss of ``model`` on ``batch`` as its docs call it: ``model(**batch).loss`` or
    ``loss_fn(model(*inputs), target)``."""
    if isinstance(batch, dict):
        out = model(**batch)
        return out["loss"], out
    return loss_fn(model(*batch[:-1]), batch[-1]), None


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
                          .tobytes()).hexdigest()[:16]


def replicated_blocks_agree(pm) -> list[str]:
    """Names of values whose blocks differ between ranks that should hold the same block
    (ranks whose coordinates differ only along mesh axes the value is replicated on)."""
    mine = {}
    for name, t in [*pm.module.named_parameters(), *pm.module.named_buffers()]:
        if isinstance(t, DTensor):
            coord = pm.mesh.get_coordinate()
            key = tuple(c if not isinstance(p, Replicate) else None
                        for c, p in zip(coord, t.placements))
            mine[name] = (key, _digest(t.to_local()))
        else:
            mine[name] = ((), _digest(t))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    differ = []
    for name in mine:
        seen: dict = {}
        for held in everyone:
            key, digest = held[name]
            if seen.setdefault(key, digest) != digest:
                differ.append(name)
                break
    return differ


def _full(t):
    """The whole of ``t``: DTensor's own ``full_tensor`` (PyTorch 2.13) mixes the pieces of
    a stacked strided shard (a fused q/k/v split by heads on both axes of a 2D mesh), so
    the runtime's gather is used, as a user's ``torchalpa.full_tensor`` is."""
    return full_value(t)


def compare_parameters(pm, ref, grads: dict, ref_grads: dict) -> dict:
    """The first step's gradients, and the parameters after the last step, against the
    single device's.

    AdamW moves every entry by about ``lr`` per step whatever its gradient's size
    (``m / sqrt(v)``), so an entry whose exact gradient is zero (a bias before batch norm,
    an attention key bias: softmax ignores a shift) or nearly so moves by rounding noise
    times ``lr``, on one device as on four. Parameters are compared within 1e-5 where the
    first gradient is above that noise (at least 1e-4 of the model's largest), and within
    ``lr * steps`` (what AdamW can move an entry at all) everywhere.
    """
    scale = max(g.abs().max().item() for g in ref_grads.values())
    grad_diff, conditioned, anywhere = 0.0, 0.0, 0.0
    for name, q in ref.named_parameters():
        p = _full(pm.module.get_parameter(name))
        diff = (p - q).abs()
        anywhere = max(anywhere, diff.max().item())
        if name not in ref_grads:
            continue
        g_ref = ref_grads[name]
        grad_diff = max(grad_diff, (_full(grads[name]) - g_ref).abs().max().item() / scale)
        above_noise = g_ref.abs() >= 1e-4 * scale
        if above_noise.any():
            conditioned = max(conditioned, diff[above_noise].max().item())
    return {"max_rel_grad_diff": grad_diff, "max_param_diff": conditioned,
            "max_param_diff_anywhere": anywhere, "param_bound_anywhere": LR * STEPS}


MESHES = {   # ``name@mesh``: another plan for the case (the default: every rank on one axis)
    "2x2": ((2, 2), torchalpa.LogicalMesh(shape=(2, 2), alpha=(2.0, 2.0), beta=(1.0, 0.1))),
}
"""``2x2``: Alpa's test mesh, whose second axis is ten times faster, so tensor parallelism
pays on it and the plan splits weights as well as the batch."""


def run(name: str) -> dict:
    name, _, mesh_name = name.partition("@")
    model, batch, loss_fn = build_case(name)
    ref, _, _ = build_case(name)
    model.train()
    ref.train()
    n = dist.get_world_size()
    shape, cluster = MESHES[mesh_name] if mesh_name else ((n,), None)
    method = torchalpa.ShardParallel(logical_mesh_shape=shape)
    pm = torchalpa.auto_parallel(model, batch, loss_fn, method=method, cluster=cluster,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    out = {"losses": [], "ref_losses": [], "loss_bits_agree": [],
           "unsupported": sorted({u["op"] for u in pm.plan.unsupported_ops}),
           "sharded_params": sum(any(str(p) != "R" for p in v.placements)
                                 for v in pm.plan.parameters)}
    keyword = isinstance(batch, dict)
    if not keyword and any(b.is_floating_point() for b in ref.buffers()):
        out["max_buffer_diff"] = predict_writes_buffers(pm, ref, batch[:-1])
    for step in range(STEPS):
        if step == 0:
            if keyword:
                result = pm(**batch)
                out["returns"] = type(result).__name__
                loss = result["loss"]
            else:
                loss = pm(*batch)
            loss.backward()
            grads = {k: p.grad for k, p in pm.module.named_parameters()}
            pm.optimizer.step()
            pm.optimizer.zero_grad(set_to_none=True)
        else:
            loss = pm.train_step(**batch) if keyword else pm.train_step(*batch)
        ref_loss, ref_out = call(ref, batch, loss_fn)
        if step == 0 and keyword:
            out["ref_returns"] = type(ref_out).__name__
        ref_loss.backward()
        if step == 0:
            ref_grads = {k: q.grad.clone() for k, q in ref.named_parameters()
                         if q.grad is not None}
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        everyone = [None] * n
        dist.all_gather_object(everyone, _digest(loss.detach()))
        out["loss_bits_agree"].append(len(set(everyone)) == 1)
        out["losses"].append(loss.item())
        out["ref_losses"].append(ref_loss.item())
    out.update(compare_parameters(pm, ref, grads, ref_grads))
    out["replicated_differ"] = replicated_blocks_agree(pm)
    return out


def predict_writes_buffers(pm, ref, inputs) -> float:
    """A train-mode forward-only call updates batch-norm statistics as one device does:
    the largest difference of the float buffers after ``predict`` (before any step, while
    both sides hold the same weights)."""
    with torch.no_grad():
        pm.predict(*inputs)
        ref(*inputs)
    return max((_full(b) - r).abs().max().item()
               for (_, b), (_, r) in zip(pm.module.named_buffers(), ref.named_buffers())
               if r.is_floating_point())


def main():
    warnings.filterwarnings("ignore")
    out_path, names = sys.argv[1], sys.argv[2].split(",")
    init_distributed()
    results = {"world_size": dist.get_world_size()}
    for name in names:
        results[name] = attempt(lambda: run(name))
    finish(results, out_path)


if __name__ == "__main__":
    main()
