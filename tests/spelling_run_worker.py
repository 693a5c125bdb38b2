"""Run on 4 gloo ranks by tests/test_spelling.py: a spelling of tests/test_spelling.py's
BERT self-attention planned on its 2x2 mesh with its unit costs and Alpa's space (the plan
``test_spelling_plans_like_the_reference`` checks), then trained beside one device.

Scenario ``SPELLING:2x2`` (a ``qkv`` spelling, e.g. ``major_split``): the model with its
harness sizes (B 4, S 8, H 32, 4 heads), real inputs (a few key positions masked), two
steps of SGD with momentum (lr 0.1, 0.9) beside one device (not Adam: softmax cancels the
key bias, whose gradient is float noise that Adam's first steps scale up: measured
qkv.bias 3.3e-4 off after two Adam steps, every other parameter within 2e-7); then the trained state saved with
``save_checkpoint`` and loaded into a model planned the same from other weights, and the
one-device model's weights written as a safetensors snapshot by rank 0 and read with
``load_pretrained`` into another. Each records the parameters' differences from what it
should hold (the whole tensors, ``full_value``), the plan's parameter and momentum
layouts, its objective, and the collectives planned and issued per step.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from test_spelling import MESHES, METHOD, Attention, B, H, S, mse  # noqa: E402
from worker_io import mesh_shape, run_scenarios, train_beside_one_device  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.core.placement import short_form  # noqa: E402
from torchalpa.runtime.lowering.strided_dtensor import full_value  # noqa: E402


def _batch(step: int):
    g = torch.Generator().manual_seed(10 + step)
    mask = torch.ones(B, S, dtype=torch.int64)
    mask[:, -2:] = 0                                    # padded keys
    return torch.randn(B, S, H, generator=g), mask, torch.randn(B, S, H, generator=g)


def _diff(pm, ref) -> dict:
    """Per parameter: [max |ours - ref|, max |ref|], both gathered whole."""
    out = {}
    for (name, p), q in zip(pm.module.named_parameters(), ref.parameters()):
        mine, theirs = full_value(p.detach()), full_value(q.detach())
        out[name] = [(mine - theirs).abs().max().item(), theirs.abs().max().item()]
    return out


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def spelling(name: str, shape: tuple[int, ...]) -> dict:
    mesh = MESHES["2d2x2"]
    assert tuple(mesh.shape) == shape
    method = torchalpa.ShardParallel(logical_mesh_shape=shape,
                                     auto_sharding_option=METHOD.auto_sharding_option)

    def planned(seed: int):
        torch.manual_seed(seed)
        return torchalpa.auto_parallel(Attention(name), _batch(0), mse, cluster=mesh,
                                       method=method,
                                       optimizer=_sgd)

    torch.manual_seed(0)
    ref = Attention(name)
    pm = planned(0)
    run = train_beside_one_device(pm, ref, _sgd(ref.parameters()),
                                  _batch, mse, steps=2, backward_steps=())
    out = {"objective": pm.plan.estimates.objective, "losses": run["losses"],
           "ref_losses": run["ref_losses"], "executed": run["executed"],
           "planned": run["planned"], "trained": _diff(pm, ref),
           "placements": {p.name: [short_form(x) for x in p.placements]
                          for p in pm.plan.parameters},
           "states": {n: {k: [short_form(x) for x in v.placements]
                          for k, v in pm.optimizer.state[p].items() if hasattr(v, "placements")}
                      for n, p in pm.module.named_parameters()}}
    shared = os.path.dirname(sys.argv[1])          # the JSON's folder, on every rank
    torchalpa.save_checkpoint(os.path.join(shared, f"ckpt_{name}"), pm)
    resumed = planned(1)
    torchalpa.load_checkpoint(os.path.join(shared, f"ckpt_{name}"), resumed)
    out["checkpoint"] = _diff(resumed, pm)
    out["checkpoint_next"] = [resumed.train_step(*_batch(2)).item(),
                              pm.train_step(*_batch(2)).item()]
    snapshot = os.path.join(shared, f"snapshot_{name}")
    if dist.get_rank() == 0:
        from safetensors.torch import save_file
        os.makedirs(snapshot, exist_ok=True)
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()},
                  os.path.join(snapshot, "model.safetensors"))
    dist.barrier()
    loaded = planned(2)
    torchalpa.load_pretrained(loaded, snapshot)
    out["pretrained"] = _diff(loaded, ref)
    return out


def main():
    run_scenarios(lambda name, shape: spelling(name, mesh_shape(shape)))


if __name__ == "__main__":
    main()
