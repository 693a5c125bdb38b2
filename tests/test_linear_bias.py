"""A linear layer's bias added inside its GEMM after lowering (runtime/rewrites/linear_bias.py), on
hand-built local graphs; a whole bf16 step: tests/test_bf16_kernels.py."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from torchalpa.runtime.rewrites.linear_bias import fuse_linear_bias

aten = torch.ops.aten


def linear_graph(bias_dtype=torch.float32, bias_first=False, product_read_twice=False):
    """(x, w, b) -> x @ w + b as the capture decomposes it, and the source map the
    lowering would give (every node its own source, ``meta["val"]`` its value's spec)."""
    graph = fx.Graph()
    x, w, b = (graph.placeholder(n) for n in "xwb")
    product = graph.call_function(aten.mm.default, (x, w))
    out = graph.call_function(aten.add.Tensor, (b, product) if bias_first else (product, b))
    graph.output((out, product) if product_read_twice else (out,))
    specs = {x: torch.empty(8, 16), w: torch.empty(16, 4), b: torch.empty(4, dtype=bias_dtype),
             product: torch.empty(8, 4), out: torch.empty(8, 4)}
    for n, v in specs.items():
        n.meta["val"] = v
    return fx.GraphModule(torch.nn.Module(), graph), {n: n for n in specs}


def ops(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("bias_first", [False, True])
def test_the_bias_is_added_inside_addmm(bias_first):
    gm, source_of = linear_graph(bias_first=bias_first)
    x, w, b = torch.randn(8, 16), torch.randn(16, 4), torch.randn(4)
    want = gm(x, w, b)[0]
    assert fuse_linear_bias(gm.graph, source_of) == 1
    gm.recompile()
    assert ops(gm) == [aten.addmm.default]
    torch.testing.assert_close(gm(x, w, b)[0], want)          # rounded once, not twice
    torch.testing.assert_close(gm(x, w, b)[0], torch.nn.functional.linear(x, w.T, b),
                               rtol=0, atol=0)                # eager's kernel: the same bits


def test_a_product_read_elsewhere_a_bias_of_another_dtype_or_a_held_add_stay():
    gm, source_of = linear_graph(product_read_twice=True)
    assert fuse_linear_bias(gm.graph, source_of) == 0
    gm, source_of = linear_graph(bias_dtype=torch.bfloat16)
    assert fuse_linear_bias(gm.graph, source_of) == 0
    gm, source_of = linear_graph()
    add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    assert fuse_linear_bias(gm.graph, source_of, keep=frozenset({add})) == 0
    assert ops(gm) == [aten.mm.default, aten.add.Tensor]


def test_a_value_the_lowering_made_by_a_plan_step_is_not_fused():
    """A bias read through a plan step is that step's call, which has no source node."""
    gm, source_of = linear_graph()
    b = next(n for n in gm.graph.nodes if n.name == "b")
    del source_of[b]
    assert fuse_linear_bias(gm.graph, source_of) == 0
