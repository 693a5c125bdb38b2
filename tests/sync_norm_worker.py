"""Run on gloo ranks by tests/test_sync_norm.py: Alpa's conv net (conv, BatchNorm, relu,
max pool) trained data parallel with synchronized batch norm, next to the same model on
one device. Rank 0 writes what it saw as JSON to argv[1]; argv[2] lists the scenarios
(``<name>:<mesh shape>``, e.g. ``conv:4`` or ``conv:2x2``; ``wide:4`` is a wide, small
batch net planned model parallel, where batch norm's forward and backward read one
all-reduced convolution output: ``Reshard.same_as``).

Each scenario plans with Alpa's unit costs (alpha = beta = 1), which split the batch, then
records: the batch norm ops the plan synchronizes, the loss of 3 SGD steps on both sides,
the gradients of the first step, the parameters and running statistics after the last,
and the collectives each step issued next to the plan's.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from alpa_cases import ConvNet  # noqa: E402
from worker_io import max_rel, mesh_shape, run_scenarios, train_beside_one_device  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.runtime.measurement.issued import issued_collectives  # noqa: E402

# (layers, batch, image size, channels) per net
NETS = {"conv": (3, 16, 16, 4), "wide": (2, 2, 4, 16)}


def batch(step: int, num_layers: int, size: int, image: int, channel: int):
    g = torch.Generator().manual_seed(200 + step)
    out = image // 2 ** num_layers
    return (torch.randn(size, channel, image, image, generator=g) * 2 + 1,
            torch.randn(size, channel, out, out, generator=g))


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def conv(net: str, shape: tuple[int, ...]) -> dict:
    num_layers, _, _, channel = NETS[net]
    torch.manual_seed(0)
    model = ConvNet(num_layers, channel)
    torch.manual_seed(0)
    ref = ConvNet(num_layers, channel)
    mesh = torchalpa.LogicalMesh(shape=shape, alpha=(1.0,) * len(shape),
                                 beta=(1.0,) * len(shape))
    pm = torchalpa.auto_parallel(
        model, batch(0, *NETS[net]), F.mse_loss, cluster=mesh,
        method=torchalpa.ShardParallel(logical_mesh_shape=shape),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    run = train_beside_one_device(pm, ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                                  lambda step: batch(step, *NETS[net]), F.mse_loss, steps=3)
    out = {"batch_synced": sorted(s.node for s in pm.plan.strategies if s.batch_syncs),
           "planned": sorted([c.kind, c.axis, c.bytes] for c in issued_collectives(pm.plan)),
           "shared_reads": sum(1 for r in pm.plan.reshards if r.same_as is not None),
           "executed": run["executed"], "planned_per_step": run["planned"],
           "losses": run["losses"],
           "ref_losses": run["ref_losses"], "grad_rel_diff": max_rel(run["grads"][0])}
    trained = pm.unwrap().state_dict()
    expected = ref.state_dict()
    out["state_rel_diff"] = {k: rel_diff(trained[k].double(), v.double())
                             for k, v in expected.items()}
    return out


def main():
    run_scenarios(lambda name, shape: conv(name, mesh_shape(shape)))


if __name__ == "__main__":
    main()
