"""``torch.compile(pm)``: the parallelized step traces as one graph, with the same numbers.

Dynamo used to break the graph twice: at the step clock (``time.perf_counter``) and at the
backward's ``grad_loss.item()`` check. Both now stand aside while compiling. The one
runner then broke it once more: backward popped from the forward's step, and dynamo lets
neither half of an autograd.Function mutate what the other made; now the forward hands its
saved tensors over by ``save_for_backward`` and buffer updates are stored after the call.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import MLP, mlp_inputs
from torch.distributed.tensor import DTensor

import torchalpa

pytestmark = pytest.mark.usefixtures("single_process_world")   # conftest.py


def test_compiled_step_has_no_graph_break_and_the_same_gradients():
    x, y = mlp_inputs(8, 16)
    pm = torchalpa.auto_parallel(MLP(16, 2), (x, y), F.mse_loss, method=torchalpa.ShardParallel())
    torch._dynamo.reset()
    explained = torch._dynamo.explain(pm)(x, y)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1

    loss = pm(x, y)
    loss.backward()
    want = [p.grad.full_tensor().clone() for p in pm.parameters()]
    pm.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(pm, backend="eager", fullgraph=True)
    got_loss = compiled(x, y)
    got_loss.backward()
    assert torch.equal(got_loss.detach(), loss.detach())
    for g, w in zip((p.grad.full_tensor() for p in pm.parameters()), want):
        torch.testing.assert_close(g, w)


def _running_mean(pm) -> torch.Tensor:
    buf = pm.module.get_buffer("1.running_mean")
    return buf.full_tensor() if isinstance(buf, DTensor) else buf


def test_compiled_step_writes_batch_norm_statistics_back_without_a_graph_break():
    """The step's new buffer values leave the autograd.Function as outputs and are stored
    after it, so compiling keeps one graph and the running statistics follow PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, method=torchalpa.ShardParallel())
    torch._dynamo.reset()
    explained = torch._dynamo.explain(pm)(x, y)      # runs the step once
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    torch._dynamo.reset()
    torch.compile(pm, backend="eager", fullgraph=True)(x, y).backward()
    for _ in range(2):
        F.mse_loss(reference(x), y).backward()
    assert not torch.equal(reference[1].running_mean, torch.zeros(32))
    torch.testing.assert_close(_running_mean(pm), reference[1].running_mean)
