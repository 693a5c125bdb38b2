"""``Plan.to_tp_plan()``: a torchalpa plan as torch's ``parallelize_module`` plan.

The plans are made in one process for a 2-device logical mesh; applying the exported plan
with ``parallelize_module`` on a 2-rank fake process group gives every parameter the
placements the plan chose (the fake group runs no communication: layouts only).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from models import mlp_inputs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import torchalpa
from torchalpa.interop.tp_plan import NotExpressibleError


class Tower(nn.Module):
    """An embedding, a Megatron MLP (up: column-split, down: row-split) and a norm."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, ids):
        return self.norm(self.down(F.relu(self.up(self.embed(ids)))))


MEGATRON = {r"embed\.weight": "S(1)", r"up\.weight": "S(0)", r"up\.bias": "S(0)",
            r"down\.weight": "S(1)", r"down\.bias": "R", r"norm\..*": "R"}


def plan_for(model, pin, shape=(2,)):
    ids = torch.randint(32, (4, 8))
    target = torch.randn(4, 8, 16)
    method = torchalpa.ShardParallel(
        auto_sharding_option=torchalpa.AutoShardingOption(pin=pin))
    mesh = torchalpa.LogicalMesh(shape=shape, alpha=(1.0,) * len(shape),
                                 beta=(1.0,) * len(shape))
    return torchalpa.plan(model, (ids, target), F.mse_loss, method=method, cluster=mesh)


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,))
    dist.destroy_process_group()


def test_applying_the_exported_plan_reproduces_the_plans_layouts(fake_world):
    model = Tower()
    plan = plan_for(model, MEGATRON)
    styles = plan.to_tp_plan(model)
    assert {k: type(v) for k, v in styles.items()} == {
        "embed": ColwiseParallel, "up": ColwiseParallel, "down": RowwiseParallel}
    parallelize_module(model, fake_world, styles)
    for name, p in model.named_parameters():
        want = plan.parameter(name).placements
        got = tuple(p.placements) if hasattr(p, "placements") else (torch.distributed.tensor
                                                                    .Replicate(),)
        assert got == tuple(want), f"{name}: {got} vs the plan's {want}"


def test_without_the_model_linears_are_inferred_from_names():
    plan = plan_for(Tower(), MEGATRON)
    # by name alone 'embed' (one 2-D weight) reads as a bias-less Linear: its S(1) weight
    # is then RowwiseParallel's; given the model, it is the Embedding's ColwiseParallel
    assert isinstance(plan.to_tp_plan()["embed"], RowwiseParallel)
    x, y = mlp_inputs(8, 16)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    method = torchalpa.ShardParallel(auto_sharding_option=torchalpa.AutoShardingOption(
        pin={r"0\.weight": "S(0)", r"0\.bias": "S(0)", r"2\.weight": "S(1)", r"2\.bias": "R"}))
    mlp_plan = torchalpa.plan(mlp, (x, y), F.mse_loss, method=method,
                              cluster=torchalpa.LogicalMesh(shape=(2,), alpha=(1.0,), beta=(1.0,)))
    assert {k: type(v) for k, v in mlp_plan.to_tp_plan().items()} == {
        "0": ColwiseParallel, "2": RowwiseParallel}


def test_layouts_without_a_parallel_style_are_named():
    model = Tower()
    odd_bias = dict(MEGATRON, **{r"up\.bias": "R"})     # column-split weight, whole bias
    with pytest.raises(NotExpressibleError, match=r"module 'up' \(Linear\) is placed bias R, "
                       r"weight S\(0\)"):
        plan_for(model, odd_bias).to_tp_plan(model)
    # the embedding pinned to a style's layout on axis 1, so up.weight is the one layout
    # off that axis (left free, the planner may shard it over axis 0 too, ZeRO-like)
    zero = {r"up\.weight": ("S(0)", "R"), r"down\.weight": ("R", "S(1)"),
            r"embed\.weight": ("R", "S(1)")}
    plan = plan_for(model, zero, shape=(2, 2))
    with pytest.raises(NotExpressibleError, match=r"over mesh axes \[0, 1\].*pass axis="):
        plan.to_tp_plan(model)
    with pytest.raises(NotExpressibleError, match=r"up\.weight is placed \(S\(0\), R\).*other "
                       r"than the tensor-parallel axis 1"):
        plan.to_tp_plan(model, axis=1)
