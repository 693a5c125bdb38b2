"""Run on gloo ranks by tests/test_plan_variety.py: one model planned on a 2 x 2 mesh
under several cost settings, so that the ILP picks different layouts (data parallel,
Megatron-like, mixed), each run for one step next to the same model on one device.

argv[2] lists scenarios ``<model>:<costs>``: a zoo family (``gpt``, ``llama``, ``bert``,
``vit``, ``moe``, ``resnet``) or ``bertlayers`` (Alpa's BERT layers), and a key of
``COSTS``. Random ops draw as one device does (``random="replicated"``, the same seed on
both sides), so every difference is the runtime's. Rank 0 writes per scenario: both
losses, the largest gradient difference relative to the largest reference gradient of
the model (a gradient that is zero in exact arithmetic, such as attention's key bias,
is float noise on both sides), the parameters held split, and the collectives the step
issued next to the plan's.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from alpa_cases import BertLayers, mse  # noqa: E402
from worker_io import run_scenarios  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402
from torchalpa.core.placement import Replicate  # noqa: E402
from torchalpa.runtime.lowering.strided_dtensor import full_value  # noqa: E402
from torchalpa.runtime.measurement.comm_count import CollectiveCounter  # noqa: E402
from torchalpa.runtime.measurement.issued import issued_collectives  # noqa: E402

COSTS = {   # (alpha, beta) per mesh axis
    "alpa": ((2.0, 2.0), (1.0, 0.1)),       # Alpa's test mesh: axis 1 ten times faster
    "flipped": ((2.0, 2.0), (0.1, 1.0)),
    "unit": ((1.0, 1.0), (1.0, 1.0)),
    "cheap": ((1e-5, 1e-5), (1e-10, 1e-10)),  # communication nearly free: memory decides
}


def _workload(name: str):
    """(build, batch, loss_fn) of ``name``."""
    if name == "bertlayers":
        g = torch.Generator().manual_seed(0)
        batch = (torch.randn(8, 8, 64, generator=g), torch.ones(8, 8, dtype=torch.int64),
                 torch.randn(8, 8, 64, generator=g))
        return lambda: BertLayers(2, 64, 4), batch, mse
    w = zoo.tiny(name, batch_size=4)
    return w.build, w.example_inputs(), w.loss_fn


def run(name: str, costs: str) -> dict:
    torch.manual_seed(0)        # every rank draws the same batch
    build, batch, loss_fn = _workload(name)
    torch.manual_seed(1)
    model = build()
    ref = copy.deepcopy(model)
    alpha, beta = COSTS[costs]
    option = torchalpa.AutoShardingOption(random="replicated")
    pm = torchalpa.auto_parallel(
        model, batch, loss_fn, cluster=torchalpa.LogicalMesh(shape=(2, 2), alpha=alpha, beta=beta),
        method=torchalpa.ShardParallel(logical_mesh_shape=(2, 2), auto_sharding_option=option))
    torch.manual_seed(5)
    with CollectiveCounter.for_mesh(pm.mesh) as counter:
        loss = pm(*batch)
        loss.backward()
    torch.manual_seed(5)
    ref_loss = loss_fn(ref(*batch[:-1]), batch[-1])
    ref_loss.backward()
    refs = [q.grad for q in ref.parameters()]
    scale = max(g.abs().max().item() for g in refs if g is not None)
    worst, worst_name = 0.0, ""
    for (fqn, p), g in zip(pm.named_parameters(), refs):
        if g is None:
            continue
        ours = full_value(p.grad)
        diff = (ours - g).abs().max().item() / scale
        if diff > worst:
            worst, worst_name = diff, fqn
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "grad_diff": worst,
            "worst": worst_name,
            "split": sorted(p.name for p in pm.plan.parameters
                            if any(not isinstance(x, Replicate) for x in p.placements)),
            "executed": sorted([r.kind, r.axis, r.bytes] for r in counter.records),
            "planned": sorted([c.kind, c.axis, c.bytes] for c in issued_collectives(pm.plan))}


def main():
    run_scenarios(run)


if __name__ == "__main__":
    main()
