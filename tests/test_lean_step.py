"""A leaner per-step program (issue 19): ``torchalpa::batched_matmul`` run as its body
(runtime/rewrites/inline_batched_matmul.py). The deferred mean-loss tail: tests/test_deferred_loss.py; real
ranks: tests/test_distributed.py and tests/test_runtime.py."""

from __future__ import annotations

import torch
import torch.fx as fx

from torchalpa.ops.batched_matmul import batched_matmul
from torchalpa.runtime.rewrites.inline_batched_matmul import inline_batched_matmul


def product_program() -> fx.GraphModule:
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output(graph.call_function(torch.ops.torchalpa.batched_matmul.default, (a, b)))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_batched_matmul_runs_as_its_body_bit_for_bit():
    gm = product_program()
    a, b = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 4, 7)
    want = gm(a, b)
    assert torch.equal(want, batched_matmul(a, b))
    assert inline_batched_matmul(gm.graph) == 1
    gm.recompile()
    assert "batched_matmul" not in gm.code
    got = gm(a, b)
    assert torch.equal(got, want) and got.is_contiguous()


def test_a_held_product_is_left_alone():
    gm = product_program()
    held = frozenset(n for n in gm.graph.nodes if n.op == "call_function")
    assert inline_batched_matmul(gm.graph, keep=held) == 0
