"""Run under torchrun by tests/test_runtime_dist.py: the runtime's training-loop features on
real gloo ranks, several scenarios per launch. Rank 0 writes what it saw as JSON to argv[1];
argv[2] lists the scenarios, argv[3] is a directory shared between launches (checkpoints).

Every scenario trains with torchalpa and, on each rank, the same model on a single device
from the same initial weights and data, and records both sides for the test to compare.

``runtime_worker.py --fault raise|hang`` is launched as plain processes (see ``fault``).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from models import MLP, FusedAttention, fused_attention_by_heads, mlp_inputs  # noqa: E402
from quickstart import MLP as QuickstartMLP  # noqa: E402
from worker_io import attempt, finish, max_rel, named_input_faults, train_beside_one_device  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.core.plan import OutputSlot  # noqa: E402
from torchalpa.runtime.execution.mesh import init_distributed  # noqa: E402
from torchalpa.runtime.execution.precision import CastForward, MixedPrecision  # noqa: E402
from torchalpa.runtime.lowering.strided_dtensor import full_value  # noqa: E402
from torchalpa.runtime.measurement.issued import issued_collectives  # noqa: E402
from torchalpa.runtime.rewrites.buckets import gradient_buckets  # noqa: E402
from torchalpa.runtime.state.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402


# Scenarios that need sharded layouts (not DDP's) plan for a CPU cluster that prices each
# gradient all-reduce on its own, as Alpa does: the default (measured, bucket-priced) gloo
# cluster rightly makes these small MLPs data parallel, which would test nothing here.
def per_gradient_cpu(num_devices: int) -> torchalpa.Cluster:
    return dataclasses.replace(torchalpa.Cluster.local_cpu(num_devices), gradient_bucket_bytes=0)


PER_GRADIENT_CPU = per_gradient_cpu(4)

ALPA_UNIT = lambda n: torchalpa.LogicalMesh(shape=(n,), alpha=(1.0,), beta=(1.0,))  # noqa: E731


def batch(step: int, size: int, dim: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, dim, generator=g), torch.randn(size, dim, generator=g)


def twin(make):
    """The same model twice from the same seed: one for torchalpa, one for reference."""
    torch.manual_seed(0)
    a = make()
    torch.manual_seed(0)
    return a, make()


def max_rel_diff(ours, refs) -> float:
    return max((full_value(p) - q).abs().max().item()
               / max(q.abs().max().item(), 1e-12) for p, q in zip(ours, refs))


def expected_collectives(plan, k: int) -> list:
    """The plan's collectives for a step of k micro-batches: the final resharding of each
    gradient once (gradient all-reduces merged into buckets), everything else once per
    micro-batch."""
    return sorted([c.kind, c.axis, c.bytes] for c in issued_collectives(plan, k))


def per_gradient_collectives(plan, k: int) -> list:
    """As ``expected_collectives`` with one collective per gradient (no buckets)."""
    out = []
    for r in plan.reshards:
        once = isinstance(r.slot, OutputSlot) and r.slot.kind == "grad"
        for s in r.steps:
            if s.is_collective:
                out += [[s.kind, s.axis, s.bytes]] * (1 if once else k)
    return sorted(out)


# -- scenarios ----------------------------------------------------------------------------

def micro_batches(make, batch_size, dim, k, **auto_kw):
    """k micro-batches: gradients of loss.backward() and 3 train_steps vs the whole batch."""
    model, ref = twin(make)
    x, y = batch(0, batch_size, dim)
    auto_kw.setdefault("method", torchalpa.ShardParallel())
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, num_micro_batches=k,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3), **auto_kw)
    run = train_beside_one_device(pm, ref, torch.optim.Adam(ref.parameters(), lr=1e-3),
                                  lambda step: batch(step, batch_size, dim), F.mse_loss, steps=3)
    return {"losses": run["losses"], "ref_losses": run["ref_losses"],
            "executed": run["executed"],
            "grad_rel_diff": max_rel(run["grads"][0]),
            "param_rel_diff": max_rel(run["params"]),
            "expected": expected_collectives(pm.plan, k),
            "planned_once": expected_collectives(pm.plan, 1),
            "per_gradient": per_gradient_collectives(pm.plan, k),
            "bucket_sizes": [len(b.params) for b in gradient_buckets(pm.plan)],
            "input_shape": list(pm.plan.inputs[0].shape)}


def eager_step(model: nn.Module, loss_fn):
    """One device's eager step: the loss, gradients left on the parameters. In bf16 its
    kernels are the lowered program's (a linear layer's bias added inside ``addmm``:
    runtime/rewrites/linear_bias.py), so the two round alike."""
    def step(*batch):
        loss = loss_fn(model(*batch[:-1]), batch[-1])
        loss.backward()
        return loss
    return step


def mixed_precision():
    """bf16 compute, fp32 masters, 3 Adam steps: a data-parallel plan against the same
    mixed-precision step on one device, the automatic plan against float32."""
    make = lambda: QuickstartMLP(64, 2)  # noqa: E731
    policy = MixedPrecision(param_dtype=torch.bfloat16)
    out = {}
    for name, method in (("dp", torchalpa.DataParallel()), ("auto", None)):
        model, ref = twin(make)
        _, ref32 = twin(make)
        x, y = batch(0, 64, 64)
        pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, mixed_precision=policy,
                                     method=method,
                                     optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
        ref_step = eager_step(CastForward(ref, policy), F.mse_loss)
        opts = [torch.optim.Adam(ref.parameters(), lr=1e-3),
                torch.optim.Adam(ref32.parameters(), lr=1e-3)]
        r = {"losses": [], "bf16_losses": [], "fp32_losses": [],
             "param_dtypes": sorted({str(p.dtype) for p in pm.parameters()}),
             "bf16_in_program": "torch.bfloat16" in pm.local_program(),
             "kinds": sorted({c.kind for c in pm.plan.collectives})}
        for step in range(3):
            x, y = batch(step, 64, 64)
            loss = pm(x, y)
            loss.backward()
            r["grad_dtypes"] = sorted({str(p.grad.dtype) for p in pm.parameters()})
            pm.optimizer.step()
            pm.optimizer.zero_grad(set_to_none=True)
            r["bf16_losses"].append(ref_step(x, y).item())
            ref_loss = F.mse_loss(ref32(x), y)
            ref_loss.backward()
            r["fp32_losses"].append(ref_loss.item())
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
            r["losses"].append(loss.item())
        r["param_rel_diff_bf16"] = max_rel_diff(list(pm.parameters()), list(ref.parameters()))
        r["param_rel_diff_fp32"] = max_rel_diff(list(pm.parameters()), list(ref32.parameters()))
        out[name] = r
    return out


class Dropped(nn.Module):
    """Dropout between two layers: eval mode and train mode differ."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(dim, 4 * dim), nn.Dropout(0.5), \
            nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class TwoHeads(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.body, self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {"a": self.a(h), "b": self.b(h)}


def inference():
    """predict / eval-mode loss / no_grad: numerics vs single device, after training too."""
    out = {}
    model, ref = twin(lambda: Dropped(32))
    x, y = batch(0, 32, 32)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
                                 method=torchalpa.ShardParallel())
    pm.eval()
    ref.eval()
    out["eval_predict_diff"] = (pm.predict(x) - ref(x)).abs().max().item()
    out["eval_loss"], out["ref_eval_loss"] = pm(x, y).item(), F.mse_loss(ref(x), y).item()
    out["eval_loss_requires_grad"] = pm(x, y).requires_grad
    pm.train()
    with torch.no_grad():
        loss = pm(x, y)
    out["no_grad_loss_requires_grad"] = loss.requires_grad
    out["grads_after_no_grad"] = [p.grad is not None for p in pm.parameters()]
    train_out = pm.predict(x)    # dropout on: differs from eval-mode outputs
    out["train_predict_differs"] = (train_out - ref(x)).abs().max().item()

    model, ref = twin(lambda: MLP(64, 3))
    pm = torchalpa.auto_parallel(model, (x.repeat(1, 2), y.repeat(1, 2)), F.mse_loss,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2),
                                 cluster=PER_GRADIENT_CPU, method=torchalpa.ShardParallel())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(2):
        xs, ys = batch(step, 32, 64)
        pm.train_step(xs, ys)
        F.mse_loss(ref(xs), ys).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    xs = batch(5, 8, 64)[0]              # another batch size: planned on first use
    out["trained_predict_diff"] = (pm.predict(xs) - ref(xs)).abs().max().item()
    out["trained_predict_scale"] = ref(xs).abs().max().item()
    out["placements"] = {v.name: [repr(p) for p in v.placements] for v in pm.plan.parameters}
    out["loss_after_predict"] = pm.train_step(*batch(9, 32, 64)).item()

    model, ref = twin(lambda: TwoHeads(32))
    pm = torchalpa.auto_parallel(model, (x,), lambda out: out["a"].square().mean(),
                                 method=torchalpa.ShardParallel())
    got, want = pm.predict(x), ref(x)
    out["dict_keys"] = sorted(got)
    out["dict_diff"] = max((got[k] - want[k]).abs().max().item() for k in want)
    return out


def conventions():
    """clip_grad_norm_, SGD with momentum + StepLR, AdamW: as on a single device."""
    out = {}
    make = lambda: QuickstartMLP(64, 2)  # noqa: E731
    model, ref = twin(make)
    x, y = batch(0, 64, 64)
    # sharded and replicated parameters whatever gloo measures on a loaded machine (the
    # measured default cluster made this MLP all-replicated there)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss,
                                 cluster=per_gradient_cpu(dist.get_world_size()),
                                 method=torchalpa.ShardParallel())
    out["placements"] = sorted({str([repr(p) for p in v.placements]) for v in pm.plan.parameters})
    opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    out.update(norms=[], ref_norms=[], losses=[], ref_losses=[], lrs=[])
    for step in range(3):
        x, y = batch(step, 64, 64)
        loss = pm(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm=0.05)
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.05)
        out["norms"].append(norm.full_tensor().item() if hasattr(norm, "full_tensor")
                            else norm.item())
        out["ref_norms"].append(ref_norm.item())
        if step == 0:
            out["clipped_grad_rel_diff"] = max_rel_diff([p.grad for p in pm.parameters()],
                                                        [q.grad for q in ref.parameters()])
        for o, s in ((opt, sched), (ref_opt, ref_sched)):
            o.step()
            o.zero_grad()
            s.step()
        out["lrs"].append(opt.param_groups[0]["lr"])
        out["losses"].append(loss.item())
        out["ref_losses"].append(ref_loss.item())
    out["sgd_param_rel_diff"] = max_rel_diff(list(pm.parameters()), list(ref.parameters()))
    out["momentum_is_dtensor"] = all(hasattr(opt.state[p]["momentum_buffer"], "placements")
                                     for p in pm.parameters())

    model, ref = twin(make)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, optimizer=lambda ps:
                                 torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
                                 method=torchalpa.ShardParallel())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    out["adamw_losses"], out["adamw_ref_losses"] = [], []
    for step in range(3):
        x, y = batch(step, 64, 64)
        out["adamw_losses"].append(pm.train_step(x, y).item())
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["adamw_ref_losses"].append(ref_loss.item())
    out["adamw_param_rel_diff"] = max_rel_diff(list(pm.parameters()), list(ref.parameters()))
    return out


def meta_init():
    """A model built on meta: only local blocks exist, they are initialized, it trains."""
    with torch.device("meta"):
        model = QuickstartMLP(64, 4)
    x, y = batch(0, 64, 64)
    method = torchalpa.ShardParallel(
        auto_sharding_option=torchalpa.AutoShardingOption(parameters="sharded"))
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, method=method,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))
    out = {"params": {}}
    n, rank = dist.get_world_size(), dist.get_rank()
    for v in pm.plan.parameters:
        p = pm.module.get_parameter(v.name)
        local = p.to_local()
        blocks = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(blocks, local.contiguous())
        sharded = any(type(q).__name__ == "Shard" for q in v.placements)
        out["params"][v.name] = {
            "global": list(v.shape), "local": list(local.shape),
            "storage_numel": local.untyped_storage().nbytes() // local.element_size(),
            "sharded": sharded,
            "blocks_equal": all(torch.equal(b, blocks[0]) for b in blocks),
            "std": float(local.detach().std()) if local.numel() > 1 else 0.0}
    losses = [pm.train_step(*batch(0, 64, 64)).item() for _ in range(5)]
    out["losses"] = losses
    out["rank"] = rank
    state = []
    for p in pm.parameters():
        state += [p.grad] + [s for s in pm.optimizer.state[p].values() if s.dim() > 0]
    out["state_full_numels"] = sorted({s.to_local().numel() == s.numel() for s in state
                                       if hasattr(s, "placements")
                                       and any(type(q).__name__ == "Shard" for q in s.placements)})
    return out


def checkpoint(shared: str):
    """Save after 2 steps; resume the same plan bit-identically, and into a 2x2 mesh."""
    make = lambda: QuickstartMLP(32, 4)  # noqa: E731
    x, y = batch(0, 64, 32)
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
    torch.manual_seed(0)
    pm = torchalpa.auto_parallel(make(), (x, y), F.mse_loss, optimizer=adam,
                                 cluster=PER_GRADIENT_CPU, method=torchalpa.ShardParallel())
    path = os.path.join(shared, "ckpt")
    out = {"uninterrupted": [], "mesh": list(pm.plan.mesh_shape),
           "placements_1d": {v.name: [repr(p) for p in v.placements] for v in pm.plan.parameters}}
    for step in range(4):
        if step == 2:
            save_checkpoint(path, pm)
        out["uninterrupted"].append(pm.train_step(*batch(step, 64, 32)).item())

    def resume(**kw):
        torch.manual_seed(123)                     # other initial weights: all must be loaded
        kw.setdefault("method", torchalpa.ShardParallel())
        fresh = torchalpa.auto_parallel(make(), (x, y), F.mse_loss, optimizer=adam,
                                        cluster=PER_GRADIENT_CPU, **kw)
        load_checkpoint(path, fresh)
        return fresh, [fresh.train_step(*batch(step, 64, 32)).item() for step in (2, 3)]

    _, out["resumed"] = resume()
    pm2d, out["resumed_2x2"] = resume(method=torchalpa.ShardParallel(logical_mesh_shape=(2, 2)))
    out["placements_2x2"] = {v.name: [repr(p) for p in v.placements]
                             for v in pm2d.plan.parameters}
    dp, out["resumed_dp"] = resume(method=torchalpa.DataParallel())   # every layout changes
    out["placements_dp"] = {v.name: [repr(p) for p in v.placements] for v in dp.plan.parameters}
    return out


def checkpoint_strided(shared: str, tag: str = ""):
    """A fused q/k/v split by heads (a strided shard, which DCP cannot describe) saves and
    resumes bit-identically, and its checkpoint loads into data parallelism and back."""
    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randn(4, 8, 32, generator=gen), torch.randn(4, 8, 32, generator=gen))
               for _ in range(4)]
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731

    def wrap(seed, method):
        torch.manual_seed(seed)
        return torchalpa.auto_parallel(FusedAttention(), batches[0], F.mse_loss, optimizer=adam,
                                       method=method)

    path = os.path.join(shared, f"ckpt_strided{tag}")
    dp_path = os.path.join(shared, f"ckpt_dp{tag}")
    pm = wrap(0, fused_attention_by_heads())
    out = {"placements": {v.name: [str(p) for p in v.placements] for v in pm.plan.parameters},
           "uninterrupted": [],
           "gathered": {name: full_value(p).sum().item() for name, p in pm.named_parameters()}}
    for step in range(4):
        if step == 2:
            save_checkpoint(path, pm)
        out["uninterrupted"].append(pm.train_step(*batches[step]).item())
    fresh = wrap(123, fused_attention_by_heads())
    load_checkpoint(path, fresh)
    out["resumed"] = [fresh.train_step(*batches[step]).item() for step in (2, 3)]
    dp = wrap(123, torchalpa.DataParallel())
    load_checkpoint(path, dp)
    out["resumed_dp"] = [dp.train_step(*batches[2]).item()]
    save_checkpoint(dp_path, dp)                      # and from plain layouts into strided
    back = wrap(7, fused_attention_by_heads())
    load_checkpoint(dp_path, back)
    out["resumed_back"] = [back.train_step(*batches[3]).item()]
    return out


def checkpoint_strided_as_on_2_11(shared: str):
    """``checkpoint_strided`` where DTensor refuses to redistribute a strided shard, as
    PyTorch 2.11's does (it raised ValueError there, breaking such checkpoints and
    gathers): ``runtime/lowering/strided_dtensor.py`` then gathers them itself."""
    from torch.distributed.tensor import DTensor

    from torchalpa.core.placement import split_factor_of
    keep = DTensor.redistribute
    refused = []

    def like_2_11(self, device_mesh=None, placements=None, **kwargs):
        if any(split_factor_of(p) > 1 for p in (*self.placements, *(placements or ()))):
            refused.append(1)
            raise ValueError("use_strided_shard_as_shard_order is True, but placements: ... "
                             "is unable to be interpreted into a corresponding shard_order")
        return keep(self, device_mesh, placements, **kwargs)

    DTensor.redistribute = like_2_11
    try:
        out = checkpoint_strided(shared, tag="_2_11")
    finally:
        DTensor.redistribute = keep
    return {**out, "refused": len(refused)}


def checkpoint_other_world(shared: str):
    """Load the 4-rank checkpoint on this world size and continue."""
    make = lambda: QuickstartMLP(32, 4)  # noqa: E731
    x, y = batch(0, 64, 32)
    torch.manual_seed(7)
    pm = torchalpa.auto_parallel(make(), (x, y), F.mse_loss,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2),
                                 method=torchalpa.ShardParallel())
    load_checkpoint(os.path.join(shared, "ckpt"), pm)
    return {"resumed": [pm.train_step(*batch(step, 64, 32)).item() for step in (2, 3)],
            "mesh": list(pm.plan.mesh_shape)}


def input_mismatch():
    """Rank 1 passes another batch shape on the first call: every rank names it."""
    torch.manual_seed(0)
    pm = torchalpa.auto_parallel(MLP(16, 2), mlp_inputs(8, 16), F.mse_loss,
                                 method=torchalpa.ShardParallel())
    size = 4 if dist.get_rank() == 1 else 8
    try:
        pm(*mlp_inputs(size, 16))
    except ValueError as e:
        return {"raised": str(e)}
    return {"raised": None}


def input_values():
    """Rank 1's batches have the right shape but other values: named on the first call
    by default, on every call with check_inputs="always", never with "never"."""
    torch.manual_seed(0)
    raised, _ = named_input_faults(
        lambda mode: torchalpa.auto_parallel(MLP(16, 2), mlp_inputs(8, 16), F.mse_loss,
                                             check_inputs=mode, method=torchalpa.ShardParallel()),
        lambda: mlp_inputs(8, 16), bad_rank=1, corrupt=lambda xy: (xy[0] + 1.0, xy[1]))
    return raised


def export(shared: str):
    """unwrap() gathers the trained shards; save_pretrained writes them once from rank 0;
    last_step_stats reads the last step."""
    model, ref = twin(lambda: QuickstartMLP(64, 2))
    x, y = batch(0, 64, 64)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss,   # sharded parameters to gather
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                 cluster=per_gradient_cpu(dist.get_world_size()),
                                 method=torchalpa.ShardParallel())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pm.train_step(x, y)
    F.mse_loss(ref(x), y).backward()
    ref_opt.step()
    plain = pm.unwrap()
    out = {"sharded": sum(1 for v in pm.plan.parameters
                          if any(type(q).__name__ == "Shard" for q in v.placements)),
           "plain_is_dtensor": any(hasattr(p, "placements") for p in plain.parameters()),
           "unwrap_rel_diff": max_rel_diff(list(plain.parameters()), list(ref.parameters()))}
    path = os.path.join(shared, "export")
    torchalpa.save_pretrained(pm, path)
    from safetensors.torch import load_file
    saved = load_file(os.path.join(path, "model.safetensors"))
    out["saved_rel_diff"] = max_rel_diff([saved[k] for k, _ in ref.named_parameters()],
                                         [p for _, p in ref.named_parameters()])
    stats = pm.last_step_stats()
    out["stats"] = {"step_time_s": stats.step_time_s, "includes": stats.includes,
                    "planned_collectives": stats.planned_collectives,
                    "num_collectives": len(pm.plan.collectives)}
    return out


SCENARIOS = {
    "export": export,
    "micro_dp": lambda shared: micro_batches(lambda: MLP(32, 3), 64, 32, 4,
                                             cluster=ALPA_UNIT(dist.get_world_size())),
    "micro_default": lambda shared: micro_batches(lambda: QuickstartMLP(64, 2), 64, 64, 2),
    # ZeRO-2: parameters sharded, gathered once per step for both micro-batches
    "micro_zero2": lambda shared: micro_batches(
        lambda: MLP(32, 3), 64, 32, 2, cluster=ALPA_UNIT(dist.get_world_size()),
        method=torchalpa.Zero2Parallel(logical_mesh_shape=(dist.get_world_size(),))),
    "mixed_precision": lambda shared: mixed_precision(),
    "inference": lambda shared: inference(),
    "conventions": lambda shared: conventions(),
    "meta_init": lambda shared: meta_init(),
    "checkpoint": checkpoint,
    "checkpoint_strided": checkpoint_strided,
    "checkpoint_strided_as_on_2_11": checkpoint_strided_as_on_2_11,
    "checkpoint_other_world": checkpoint_other_world,
    "input_mismatch": lambda shared: input_mismatch(),
    "input_values": lambda shared: input_values(),
}


def fault(kind: str) -> None:
    """Launched without torchrun (no agent to kill the others): rank 1 raises or hangs
    after its first step; rank 0 must fail on its own, naming rank 1."""
    import time
    init_distributed()
    torch.manual_seed(0)
    pm = torchalpa.auto_parallel(MLP(16, 2), mlp_inputs(8, 16), F.mse_loss,
                                 cluster=ALPA_UNIT(dist.get_world_size()),
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                 method=torchalpa.ShardParallel())
    pm.train_step(*mlp_inputs(8, 16))
    print(f"rank {dist.get_rank()}: first step done", flush=True)
    if dist.get_rank() == 1:
        if kind == "raise":
            raise ValueError("injected failure on rank 1")
        time.sleep(120)       # hung: alive, but never calls the model again
        return
    start = time.monotonic()
    try:
        pm.train_step(*mlp_inputs(8, 16))
    finally:
        print(f"rank 0: second step ended after {time.monotonic() - start:.1f} s", flush=True)


def main():
    if sys.argv[1] == "--fault":
        return fault(sys.argv[2])
    out_path, which, shared = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
    init_distributed()
    results: dict = {"world_size": dist.get_world_size()}
    for name in which:
        results[name] = attempt(lambda: SCENARIOS[name](shared))
    finish(results, out_path)


if __name__ == "__main__":
    main()
