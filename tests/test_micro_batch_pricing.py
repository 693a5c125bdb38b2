"""Gradient accumulation is priced as the step runs it (``ShardParallel.num_micro_batches``):
each micro-batch's computation and collectives count once per micro-batch, the
gradients' final reductions and the optimizer once per step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import torchalpa
from torchalpa.passes.cost import optimizer_cost, steps_cost


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
