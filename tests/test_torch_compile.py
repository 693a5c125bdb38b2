"""``torch.compile(pm)``: the parallelized step traces as one graph, with the same numbers.

Dynamo used to break the graph twice: at the step clock (``time.perf_counter``) and at the
backward's ``grad_loss.item()`` check. Both now stand aside while compiling.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchalpa
from models import MLP, mlp_inputs

pytestmark = pytest.mark.usefixtures("single_process_world")   # conftest.py


def test_compiled_step_has_no_graph_break_and_the_same_gradients():
    x, y = mlp_inputs(8, 16)
    pm = torchalpa.auto_parallel(MLP(16, 2), (x, y), F.mse_loss)
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
