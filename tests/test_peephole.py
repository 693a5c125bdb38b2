"""Decomposed patterns folded back into eager's kernels after lowering (runtime/rewrites/relu_backward.py)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
from torchalpa.runtime.rewrites.relu_backward import fold_relu_backward

aten = torch.ops.aten


def relu_backward_graph(threshold=0, zero=0, dtype=torch.float32) -> fx.GraphModule:
    graph = fx.Graph()
    grad, x = graph.placeholder("grad"), graph.placeholder("x")
    le = graph.call_function(aten.le.Scalar, (x, threshold))
    scalar = graph.call_function(aten.scalar_tensor.default, (zero,), {"dtype": dtype})
    graph.output(graph.call_function(aten.where.self, (le, scalar, grad)))
    return fx.GraphModule(torch.nn.Module(), graph)


def ops(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_relu_backward_folds_into_threshold_backward_bit_for_bit():
    gm = relu_backward_graph(threshold=0.5)
    grad, x = torch.randn(64, 32), torch.randn(64, 32)
    x[0, :4] = torch.tensor([float("nan"), 0.5, -0.0, 0.5000001])
    want = gm(grad, x)
    assert fold_relu_backward(gm.graph) == 1
    gm.recompile()
    assert ops(gm) == [aten.threshold_backward.default]
    assert torch.equal(gm(grad, x), want)


@pytest.mark.parametrize("zero,dtype", [(1, torch.float32), (0, torch.int64)])
def test_other_selects_are_left_alone(zero, dtype):
    gm = relu_backward_graph(zero=zero, dtype=dtype)
    assert fold_relu_backward(gm.graph) == 0
    assert aten.where.self in ops(gm)


@pytest.mark.usefixtures("single_process_world")
def test_a_relu_mlp_step_runs_threshold_backward_and_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
    ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, method=torchalpa.ShardParallel())
    code = pm.local_program()
    assert code.count("aten.threshold_backward.default(") == 2 and "aten.where" not in code
    pm(x, y).backward()
    F.mse_loss(ref(x), y).backward()
    for p, q in zip(pm.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-7)


def test_a_held_node_is_not_folded():
    # a pipeline stage's lowering holds its sends by reference: folding one away left the
    # backward's output pointing at an erased node (KeyError where_self_1 on 4 ranks)
    gm = relu_backward_graph()
    where = next(n for n in gm.graph.nodes if n.target is aten.where.self)
    assert fold_relu_backward(gm.graph, keep=frozenset({where})) == 0
    assert aten.where.self in ops(gm)
