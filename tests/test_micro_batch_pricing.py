"""Gradient accumulation is priced as the step runs it (``ShardParallel.num_micro_batches``):
each micro-batch's computation and collectives count once per micro-batch, the
gradients' final reductions and the optimizer once per step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import torchalpa
from torchalpa.passes.pricing.cost import optimizer_cost, steps_cost


class TwoDense(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.second(self.first(x).relu())


MESH = torchalpa.LogicalMesh(shape=(4,), alpha=(1e-4,), beta=(1e-9,), peak_flops=1e9,
                             memory_bandwidth=1e10, optimizer_tensor_s=1e-4)


def _plan(k: int, rows: int = 64):
    batch = (torch.randn(rows, 16), torch.randn(rows, 16))
    method = torchalpa.ShardParallel(logical_mesh_shape=(4,), num_micro_batches=k,
                                     auto_sharding_option=torchalpa.AutoShardingOption(
                                         parameters="replicated", force_batch_dim_to_mesh_dim=0))
    return torchalpa.plan(TwoDense(), batch, F.mse_loss, method=method, cluster=MESH)


def test_micro_batches_multiply_all_but_the_gradient_reductions():
    one, two = _plan(1), _plan(2)
    # the same data-parallel plan, made for a micro-batch of 32 rows in the second case
    assert [c.kind for c in one.collectives] == [c.kind for c in two.collectives]
    loss = [c for c in two.collectives if c.bytes == 4]
    assert len(loss) == 1           # the loss's all-reduce, the only per-micro-batch one
    # compute: a micro-batch's (the step planned on 32 rows) twice, the optimizer once
    micro = _plan(1, rows=32)
    adam = optimizer_cost(MESH, {p.node: 4.0 * math.prod(p.shape) for p in micro.parameters}, 2)
    assert adam > 0
    assert two.estimates.compute_s == pytest.approx(2 * micro.estimates.compute_s - adam,
                                                    rel=1e-9)
    # communication: the gradients once (as with one micro-batch), the loss twice
    loss_cost = steps_cost(MESH, [s for r in two.reshards for s in r.steps if s.bytes == 4])
    assert two.estimates.communication_s == pytest.approx(
        one.estimates.communication_s + loss_cost, rel=1e-9)


def test_auto_parallel_and_the_method_must_agree_on_micro_batches():
    method = torchalpa.ShardParallel(num_micro_batches=2)
    with pytest.raises(ValueError, match="num_micro_batches=4 disagrees"):
        torchalpa.auto_parallel(TwoDense(), (torch.randn(8, 16), torch.randn(8, 16)),
                                F.mse_loss, method=method, num_micro_batches=4)


def test_a_bad_count_is_refused():
    with pytest.raises(ValueError, match="positive int"):
        torchalpa.ShardParallel(num_micro_batches=0)


def _zero2_plan(k: int, rematerialize: bool = False):
    rows = 32 * k                                    # a micro-batch of 32 rows either way
    batch = (torch.randn(rows, 16), torch.randn(rows, 16))
    kind = torchalpa.Zero3Parallel if rematerialize else torchalpa.Zero2Parallel
    method = kind(logical_mesh_shape=(4,), num_micro_batches=k)
    return torchalpa.plan(TwoDense(), batch, F.mse_loss, method=method, cluster=MESH)


@pytest.mark.parametrize("rematerialize", [False, True])
def test_zero2_prices_its_parameter_gathers_once_per_step(rematerialize):
    """ZeRO-2 with micro-batches gathers each parameter once per step (the runtime's
    param_gather), so the plan prices the gathers once, as it does the gradients'
    reduce-scatters; only the loss's all-reduce counts per micro-batch. ZeRO-3 gathers
    again per micro-batch (to hold less) and is priced so."""
    one, two = _zero2_plan(1, rematerialize), _zero2_plan(2, rematerialize)
    forward_gathers = [s for r in one.reshards for s in r.steps if s.kind == "all_gather"
                       and any(p.node == r.producer for p in one.parameters)]
    assert len(forward_gathers) >= 4
    loss_cost = steps_cost(MESH, [s for r in two.reshards for s in r.steps if s.bytes == 4])
    extra = loss_cost
    if rematerialize:        # every gather of a parameter twice
        extra += steps_cost(MESH, forward_gathers)
    assert two.estimates.communication_s == pytest.approx(
        one.estimates.communication_s + extra, rel=1e-9)
