"""Every strategy a rule allows computes the right thing.

For each op and each strategy its rule yields on a 2- and 4-device 1D mesh and a 2x2
mesh: cut the operands into the blocks each rank holds, run the (localized) op on the
blocks, put the results back together by the result placements, and compare with the
op on whole tensors. Shapes vary with hypothesis.
"""

from __future__ import annotations

import operator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulate import block, combine, coords_of
from torchalpa.cluster import LogicalMesh
from torchalpa.frontends.torch_export import trace_ops
from torchalpa.passes.rules import RULES
from torchalpa.passes.strategies import enumerate_strategies
from torchalpa.plan import NodeStrategy
from torchalpa.runtime.localize import localize

MESHES = [(2,), (4,), (2, 2)]
aten = torch.ops.aten


def _run_op_sharded(node_fx, op_node, values, strategy, mesh_shape):
    """Run one fx node on every rank's blocks and combine its results."""
    ns = NodeStrategy(op_node.name, strategy.inputs, strategy.outputs)
    outs = {}
    for coord in coords_of(mesh_shape):
        slot = iter(range(len(op_node.operands)))

        def local(a):
            if not isinstance(a, torch.fx.Node):
                return a
            k = next(slot)
            placement = strategy.inputs[k]
            full = values[a.name]
            return full if placement is None else block(full, placement, mesh_shape, coord)

        args = torch.utils._pytree.tree_map(local, list(node_fx.args))
        kwargs = {k: torch.utils._pytree.tree_map(local, v) for k, v in node_fx.kwargs.items()}
        target, args, kwargs = localize(node_fx, args, kwargs, ns, mesh_shape, torch.device("cpu"))
        out = target(*args, **kwargs)
        outs[coord] = out if isinstance(out, (tuple, list)) else (out,)
    return [combine({c: o[i] for c, o in outs.items()}, strategy.outputs[i], mesh_shape)
            for i in range(len(strategy.outputs))]


def check_all_strategies(fn, args, meshes=MESHES, atol=1e-4, rtol=1e-4) -> int:
    """Check every strategy of every op in ``fn``; returns how many were checked."""
    gm, nodes = trace_ops(fn, args)
    values = {}
    checked = 0
    placeholders = iter(args)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            values[n.name] = next(placeholders)
            continue
        if n.op != "call_function":
            continue
        if n.target is operator.getitem:
            values[n.name] = values[n.args[0].name][n.args[1]]
            continue
        args_full = torch.utils._pytree.tree_map(
            lambda a: values[a.name] if isinstance(a, torch.fx.Node) else a, (n.args, n.kwargs))
        ref = n.target(*args_full[0], **args_full[1])
        values[n.name] = ref
        op_node = nodes[n.name]
        assert op_node.op in RULES, f"no rule for {op_node.op}"
        specs = [nodes[r.node].outputs[r.index] for r in op_node.operands]
        rule = RULES[op_node.op](op_node, specs)
        refs = ref if isinstance(ref, (tuple, list)) else (ref,)
        for mesh_shape in meshes:
            for strategy in enumerate_strategies(rule, LogicalMesh(shape=mesh_shape)):
                got = _run_op_sharded(n, op_node, values, strategy, mesh_shape)
                for g, r in zip(got, refs):
                    assert g.shape == r.shape, (op_node.op, strategy.name, mesh_shape)
                    assert torch.allclose(g.float(), r.float(), atol=atol, rtol=rtol), \
                        f"{op_node.op} strategy {strategy.name} on mesh {mesh_shape}"
                checked += 1
    return checked


def rnd(*shape):
    return torch.randn(*shape)


CASES = {
    "mm": (lambda a, b: torch.mm(a, b), lambda: (rnd(8, 4), rnd(4, 8))),
    "bmm": (lambda a, b: torch.bmm(a, b), lambda: (rnd(4, 4, 8), rnd(4, 8, 4))),
    "linear": (lambda x, w, b: torch.nn.functional.linear(x, w, b), lambda: (rnd(8, 4), rnd(8, 4), rnd(8))),
    "add_broadcast": (lambda a, b: a + b, lambda: (rnd(4, 8), rnd(8))),
    "sub_mul_div": (lambda a, b: (a - b) * b / 3.0, lambda: (rnd(4, 8), rnd(4, 8))),
    "mul_tensor": (lambda a, b: a * b, lambda: (rnd(4, 8), rnd(4, 1))),
    "div_tensor": (lambda a, b: a / b, lambda: (rnd(4, 8), rnd(4, 8).abs() + 1)),
    "neg_relu_pow": (lambda a: torch.relu(-a) ** 2, lambda: (rnd(8, 4),)),
    "where_le": (lambda a, b: torch.where(a <= 0, torch.zeros(()), b), lambda: (rnd(4, 8), rnd(4, 8))),
    "sum_dim_keepdim": (lambda a: a.sum(dim=0, keepdim=True), lambda: (rnd(8, 4),)),
    "sum_all": (lambda a: a.sum(), lambda: (rnd(4, 8),)),
    "mean_all": (lambda a: a.mean(), lambda: (rnd(4, 8),)),
    "mean_dim": (lambda a: a.mean(dim=(0, 2)), lambda: (rnd(4, 8, 4),)),
    "view_split_merge": (lambda a: a.view(4, 2, 8).reshape(8, 8), lambda: (rnd(8, 8),)),
    "view_general": (lambda a: a.reshape(4, 6), lambda: (rnd(6, 4),)),
    "permute_t_transpose": (lambda a: a.permute(2, 0, 1).transpose(0, 1).reshape(8, 16).t(), lambda: (rnd(4, 8, 4),)),
    "expand": (lambda a: a.expand(4, 4, 8), lambda: (rnd(4, 1, 8),)),
    "unsqueeze_squeeze": (lambda a: a.unsqueeze(1).squeeze(1).unsqueeze(0), lambda: (rnd(4, 8),)),
    "full_like_ones": (lambda a: torch.full_like(a, 2.0) + torch.ones_like(a) + a, lambda: (rnd(4, 8),)),
    "mse_loss": (lambda a, b: torch.nn.functional.mse_loss(a, b), lambda: (rnd(8, 4), rnd(8, 4))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_strategy_matches_unsharded(case):
    fn, make_args = CASES[case]
    torch.manual_seed(0)
    assert check_all_strategies(fn, make_args()) > 0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.sampled_from([2, 4, 8]), k=st.sampled_from([2, 4, 6]), n=st.sampled_from([1, 4, 8]))
def test_matmul_chain_any_shape(m, k, n):
    torch.manual_seed(0)
    check_all_strategies(lambda a, b, c: torch.relu(a @ b) + c, (rnd(m, k), rnd(k, n), rnd(n)),
                         meshes=[(2,), (2, 2)])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from([(4, 6), (8, 2, 3), (2, 4, 4), (6, 8)]), data=st.data())
def test_reshape_any_factorization(shape, data):
    numel = 1
    for s in shape:
        numel *= s
    candidates = [(numel,), (2, numel // 2), (numel // 4, 4), (numel // 2, 2)]
    target = data.draw(st.sampled_from(candidates))
    torch.manual_seed(0)
    check_all_strategies(lambda a: a.reshape(target), (rnd(*shape),), meshes=[(2,), (2, 2)])


def test_matmul_strategies_are_the_megatron_set():
    """On 4 devices mm may split m, n or k (partial) -- never run whole on every device."""
    gm, nodes = trace_ops(lambda a, b: a @ b, (rnd(8, 4), rnd(4, 8)))
    node = next(n for n in nodes.values() if n.op == "aten.mm.default")
    rule = RULES[node.op](node, [nodes[r.node].output for r in node.operands])
    names = sorted(s.name for s in enumerate_strategies(rule, LogicalMesh(shape=(4,))))
    assert names == sorted(["(S(0), R) -> S(0)", "(R, S(1)) -> S(1)", "(S(1), S(0)) -> P"])
