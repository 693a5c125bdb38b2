"""StableHLO in and out: the StableHLO frontend, XLA running a plan, export via torch-mlir.

Needs jax/jaxlib (and torch-mlir for the export tests): ``make test`` installs them with
the test extra; without them these tests skip and say which package is missing. The
multi-device XLA run happens in one subprocess (``XLA_FLAGS`` must be set before jax is
imported).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax", reason="jax/jaxlib are not installed: "
                                        "pip install 'torchalpa[stablehlo]'")
import jax.numpy as jnp  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.core.cluster import Cluster  # noqa: E402
from torchalpa.core.opgraph import Operand  # noqa: E402
from torchalpa.core.placement import Partial, Replicate, Shard  # noqa: E402
from torchalpa.frontends.jax_lower import lower_jax  # noqa: E402
from torchalpa.frontends.stablehlo import StableHLOError, from_stablehlo  # noqa: E402
from torchalpa.passes.rules import rule_for  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


needs_torch_mlir = pytest.mark.skipif(not _has("torch_mlir"), reason=(
    "torch-mlir is not installed: pip install 'torchalpa[stablehlo]'"))


# -- a JAX model with matmuls of every layout, attention, layer norm, softmax ------------

def _block_loss(params, x, y):
    """One pre-norm transformer block and a linear head; x: (B, T, C), y: (B, T, C)."""
    h = x - jnp.mean(x, axis=-1, keepdims=True)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-5) * params["ln"]
    q = jnp.einsum("btc,hcd->bhtd", h, params["wq"])                  # (B, H, T, D)
    k = jnp.einsum("btc,hcd->bhtd", h, params["wk"])
    att = jnp.einsum("bhtd,bhsd->bhts", q, k) / 2.0                    # (B, H, T, T)
    att = jax.nn.softmax(att, axis=-1)
    v = jnp.einsum("bhts,bhsd->bhtd", att, q)
    out = jnp.einsum("bhtd,hdc->btc", v, params["wo"]) + x             # (B, T, C)
    out = jnp.tanh(out @ params["w"] + params["b"])
    return jnp.mean((out - y) ** 2)


def _block_example(seed=0):
    rng = np.random.default_rng(seed)
    B, T, C, H, D = 2, 4, 8, 2, 4

    def r(*shape):
        return jnp.asarray(rng.normal(size=shape) * 0.5, jnp.float32)
    params = {"ln": r(C), "wq": r(H, C, D), "wk": r(H, C, D), "wo": r(H, D, C), "w": r(C, C),
              "b": r(C)}
    return params, r(B, T, C), r(B, T, C)


def _run_graph(graph, leaves: dict[str, torch.Tensor]):
    """Evaluate an OpGraph with the ATen ops it names: (loss, {param: grad})."""
    values = {}
    for node in graph:
        if node.is_leaf:
            values[node.name] = leaves[node.target]
            continue
        ins = [values[r.node] if r.index == 0 and not isinstance(values[r.node], tuple)
               else values[r.node][r.index] for r in node.operands]

        def sub(a):
            if isinstance(a, Operand):
                return ins[a.k]
            if isinstance(a, tuple):
                return type(a)(sub(x) for x in a)
            return a
        args = sub(node.args)
        kwargs = {k: getattr(torch, v.removeprefix("torch.")) if k == "dtype" else v
                  for k, v in node.kwargs}
        namespace, packet, overload = node.op.split(".")
        fn = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
        if node.op == "aten.full.default":
            kwargs["dtype"] = getattr(torch, node.output.dtype)
        values[node.name] = fn(*args, **kwargs)
    loss = values[graph.outputs.loss.node]
    return loss, {fqn: values[r.node] for fqn, r in graph.outputs.grads}


def test_graph_computes_what_jax_computes():
    """The OpGraph, run op by op with ATen, gives JAX's loss and gradients: every
    StableHLO op was translated into ATen ops (and shapes) that mean the same thing."""
    params, x, y = _block_example()
    lowered = lower_jax(_block_loss, (params, x, y))
    graph = from_stablehlo(lowered.text, param_names=lowered.param_names,
                           input_names=lowered.input_names)
    ops = {n.op for n in graph.ops()}
    assert {"torchalpa.batched_matmul.default", "aten.mm.default", "aten.amax.default",
            "aten.sum.dim_IntList", "aten.permute.default"} <= ops
    assert not [n.op for n in graph.ops() if rule_for(n, graph) is None]
    leaves = {name: torch.from_numpy(np.array(v)) for name, v in zip(
        lowered.param_names + lowered.input_names,
        jax.tree_util.tree_leaves(params) + [x, y])}
    loss, grads = _run_graph(graph, leaves)
    ref_loss, ref_grads = jax.value_and_grad(_block_loss)(params, x, y)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    for name, g in zip(lowered.param_names, jax.tree_util.tree_leaves(ref_grads)):
        np.testing.assert_allclose(grads[name].numpy(), np.asarray(g), rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def _merged_heads_loss(params, x):
    """Attention as torch-mlir writes it: heads merged into the batch (B * H) around each
    product, grouped-query k/v repeated, the output projection a broadcast weight."""
    B, T, C = x.shape
    H, Hkv, D = 4, 2, C // 4
    q = (x @ params["wq"]).reshape(B, T, H, D).transpose(0, 2, 1, 3)         # (B, H, T, D)
    k = (x @ params["wk"]).reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)       # (B, Hkv, T, D)
    k = jnp.broadcast_to(k[:, :, None], (B, Hkv, H // Hkv, T, D)).reshape(B, H, T, D)
    s = jnp.matmul(q.reshape(B * H, T, D), k.reshape(B * H, T, D).transpose(0, 2, 1))
    p = jax.nn.softmax(s.reshape(B, H, T, T), axis=-1)                       # (B, H, T, T)
    y = jnp.matmul(p.reshape(B * H, T, T), q.reshape(B * H, T, D)).reshape(B, H, T, D)
    y = y.transpose(0, 2, 1, 3).reshape(B, T, C)
    out = jnp.matmul(y, jnp.broadcast_to(params["wo"], (B, C, C)))          # (B, T, C)
    return jnp.mean(out ** 2)


def test_merged_head_products_read_as_batched_matmul():
    """Products over a merged B * H dim (and grouped-query k) read as
    torchalpa::batched_matmul on (B, H, ...), so heads can shard as in the ATen plan; a
    broadcast weight's product and its gradient's batch sum read as mm; the graph still
    computes JAX's loss and gradients."""
    rng = np.random.default_rng(0)
    params = {n: jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for n, s in
              (("wq", (16, 16)), ("wk", (16, 8)), ("wo", (16, 16)))}
    x = jnp.asarray(rng.normal(size=(2, 4, 16)), jnp.float32)
    lowered = lower_jax(_merged_heads_loss, (params, x))
    graph = from_stablehlo(lowered.text, param_names=lowered.param_names,
                           input_names=lowered.input_names)
    products = [n for n in graph.ops() if n.op == "torchalpa.batched_matmul.default"]
    assert len(products) == 6                       # 2 forward, 4 in backward
    for n in products:
        assert [graph.spec(r).shape[:2] for r in n.operands] == [(2, 4), (2, 4)], n
    assert not [n for n in graph.ops() if n.op == "aten.bmm.default"]
    leaves = {"params.wk": params["wk"], "params.wo": params["wo"], "params.wq": params["wq"],
              "x": x}
    loss, grads = _run_graph(graph, {k: torch.from_numpy(np.array(v)) for k, v in
                                     leaves.items()})
    ref_loss, ref_grads = jax.value_and_grad(_merged_heads_loss)(params, x)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    for name, g in ref_grads.items():
        np.testing.assert_allclose(grads[f"params.{name}"].numpy(), np.asarray(g),
                                   rtol=1e-4, atol=1e-6, err_msg=name)


def test_products_are_summed_before_the_residual():
    """``(r + x @ w1) + x @ w2`` reads as ``r + (x @ w1 + x @ w2)``: two partial sums are
    added before anything replicated joins them (one reduction, as autograd's order gives
    the ATen plan), and the graph still computes JAX's loss."""
    def loss(params, x):
        return jnp.sum(jnp.tanh((jnp.tanh(x) + x @ params["w1"]) + x @ params["w2"]))
    params = {"w1": jnp.full((8, 8), 0.1), "w2": jnp.full((8, 8), -0.2)}
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32)
    lowered = lower_jax(loss, (params, x))
    graph = from_stablehlo(lowered.text, param_names=lowered.param_names,
                           input_names=lowered.input_names)
    by_name = {n.name: n for n in graph}
    forward_adds = [n for n in graph.ops() if n.op == "aten.add.Tensor"
                    and n.phase == "forward"]
    assert [[by_name[r.node].op for r in n.operands] for n in forward_adds] == [
        ["aten.mm.default", "aten.mm.default"], ["aten.tanh.default", "aten.add.Tensor"]]
    got, _ = _run_graph(graph, {"params.w1": torch.from_numpy(np.array(params["w1"])),
                                "params.w2": torch.from_numpy(np.array(params["w2"])),
                                "x": torch.from_numpy(np.array(x))})
    assert float(got) == pytest.approx(float(loss(params, x)), rel=1e-5)


def test_plan_a_jax_step():
    params, x, y = _block_example()
    plan = torchalpa.plan(_block_loss, (params, x, y), cluster=Cluster.local_cpu(2),
                          method=torchalpa.ShardParallel())
    assert sorted(p.name for p in plan.parameters) == sorted(
        f"params.{k}" for k in params)
    assert [p.name for p in plan.inputs] == ["x", "y"]
    assert plan.unsupported_ops == ()
    assert plan.estimates.step_time_s > 0


def test_ops_without_a_rule_are_listed():
    def loss(params, x):
        return jnp.sum(jnp.flip(x @ params["w"], axis=0) * x)      # a stablehlo.reverse
    params = {"w": jnp.ones((8, 8))}
    plan = torchalpa.plan(loss, (params, jnp.ones((4, 8))), cluster=Cluster.local_cpu(2),
                          method=torchalpa.ShardParallel())
    assert "stablehlo.reverse" in {u["op"] for u in plan.unsupported_ops}


def test_embedding_gather_and_scatter_read_as_aten_embedding():
    """A row lookup (gather) and its gradient (scatter-add into zeros) are ATen's
    embedding and embedding_dense_backward, with their rules: the batch shards, and the
    graph still computes JAX's loss and gradient."""
    def loss(params, idx):
        return jnp.sum(jnp.tanh(jnp.take(params["emb"], idx, axis=0, mode="clip")) ** 2)
    params, idx = {"emb": jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)),
                                      jnp.float32)}, jnp.array([[1, 3, 3], [0, 15, 2]])
    lowered = lower_jax(loss, (params, idx))
    graph = from_stablehlo(lowered.text, param_names=lowered.param_names,
                           input_names=lowered.input_names)
    ops = [n.op for n in graph.ops()]
    assert "aten.embedding.default" in ops and "aten.embedding_dense_backward.default" in ops
    assert not [op for op in ops if op.startswith("stablehlo.")]
    got_loss, grads = _run_graph(graph, {"params.emb": torch.from_numpy(
        np.array(params["emb"])), "idx": torch.from_numpy(np.array(idx))})
    ref_loss, ref_grads = jax.value_and_grad(loss)(params, idx)
    assert float(got_loss) == pytest.approx(float(ref_loss), rel=1e-5)
    np.testing.assert_allclose(grads["params.emb"].numpy(), np.asarray(ref_grads["emb"]),
                               rtol=1e-5, atol=1e-6)


def test_fused_elementwise_chains_move_only_their_inputs_and_outputs():
    """A softmax spelled in StableHLO (max, sub, exp, sum, div) is charged what XLA's
    fusion moves: x read, the row max and row sum written and read, the result written;
    not one write and read per link."""
    def loss(params, x):
        y = x @ params["w"]                                      # (64, 32)
        return jnp.sum(jax.nn.softmax(y, axis=-1) * x[:, :32])
    params, x = {"w": jnp.ones((48, 32))}, jnp.ones((64, 48))
    lowered = lower_jax(loss, (params, x))
    graph = from_stablehlo(lowered.text, param_names=lowered.param_names,
                           input_names=lowered.input_names)
    matrix = 64 * 32 * 4
    elementwise = [n for n in graph.ops() if n.phase == "forward" and not n.aliases
                   and n.op not in ("aten.mm.default", "aten.slice.Tensor")]
    unfused = sum(sum(graph.spec(r).nbytes for r in n.operands) +
                  sum(o.nbytes for o in n.outputs) for n in elementwise)
    fused = sum(n.bytes for n in elementwise)
    assert unfused > 8 * matrix
    assert fused <= 5 * matrix, [(n.op, n.bytes) for n in elementwise if n.bytes]
    mm = next(n for n in graph.ops() if n.op == "aten.mm.default")
    assert mm.bytes == (64 * 48 + 48 * 32 + 64 * 32) * 4     # a matmul is never fused


def test_stablehlo_text_needs_to_say_which_arguments_are_parameters():
    params, x, y = _block_example()
    text = jax.jit(jax.value_and_grad(_block_loss)).lower(params, x, y).as_text()
    with pytest.raises(StableHLOError, match="num_params"):
        from_stablehlo(text)
    graph = from_stablehlo(text, num_params=len(params))
    assert len(graph.params) == len(params) and len(graph.grads) == len(params)
    loss_only = jax.jit(_block_loss).lower(params, x, y).as_text()
    with pytest.raises(StableHLOError, match="value_and_grad"):
        from_stablehlo(loss_only, num_params=len(params))


def test_plan_from_a_file(tmp_path):
    def loss(params, x):
        return jnp.mean((x @ params["w"]) ** 2)
    params, x = {"w": jnp.ones((8, 16))}, jnp.ones((32, 8))
    lowered = lower_jax(loss, (params, x))
    path = tmp_path / "step.mlir"
    path.write_text(lowered.text)
    mesh = Cluster.local_cpu(4).logical_mesh((4,))
    plan = torchalpa.plan(str(path), (), cluster=mesh, num_params=1,
                          method=torchalpa.ShardParallel())
    assert [p.name for p in plan.parameters] == ["params.w"]
    with pytest.raises(ValueError, match="neither StableHLO text nor a file"):
        torchalpa.plan(str(tmp_path / "missing.mlir"), (), cluster=mesh, num_params=1,
                       method=torchalpa.ShardParallel())


@pytest.mark.parametrize("placements,mesh_shape", [
    ((Shard(0), Replicate()), (2, 4)), ((Replicate(), Shard(1)), (2, 4)),
    ((Shard(1), Shard(0)), (2, 2)), ((Shard(0), Shard(0)), (2, 4)),
    ((Replicate(), Replicate()), (2, 2)), ((Shard(1),), (4,))])
def test_hlo_sharding_strings_match_jax(placements, mesh_shape):
    """Our ``mhlo.sharding`` strings are the ones JAX writes for the same NamedSharding."""
    from jax.sharding import AbstractMesh, NamedSharding

    from torchalpa.interop.hlo_annotate import hlo_sharding
    from torchalpa.interop.xla import partition_spec
    names = tuple(f"a{i}" for i in range(len(mesh_shape)))
    mesh = AbstractMesh(mesh_shape, names)
    spec = partition_spec(placements, 2, names)
    expected = NamedSharding(mesh, spec)._to_xla_hlo_sharding(2)
    ours = hlo_sharding(placements, 2, mesh_shape)
    from jax._src.lib import xla_client
    assert xla_client.HloSharding.from_proto(expected.to_proto()) == expected
    assert str(expected) == ours or expected.is_replicated() and ours == "{replicated}", \
        (str(expected), ours)


def test_hlo_collectives_read_merged_ops():
    from torchalpa.interop.xla import hlo_collectives
    text = """
  %all-reduce.5 = (f32[256]{0}, f32[256,64]{1,0}, f32[]) all-reduce(%a, %b, %c), channel_id=1, \
replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, to_apply=%add
  %ag = f32[64,16]{1,0} all-gather(%d), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
  %rs = f32[8]{0} reduce-scatter(%e), channel_id=3, replica_groups={{0,1},{2,3}}, dimensions={0}
"""
    found = hlo_collectives(text)
    assert [(c["kind"], c["tensors"], c["bytes"]) for c in found] == [
        ("all_reduce", 3, (256 + 256 * 64 + 1) * 4), ("all_gather", 1, 64 * 16 * 4 // 4),
        ("reduce_scatter", 1, 8 * 4 * 2)]


@pytest.mark.slow
def test_xla_runs_the_plan_on_four_devices(tmp_path):
    """examples/jax_quickstart.py in a subprocess with 4 host devices: XLA runs the plan's
    annotated StableHLO (shardings at the arguments, results and between ops); losses and
    parameters match one device, and XLA's compiled collectives are the plan's.

    One known difference, asserted: the plan sums the last bias's gradient over its batch
    slice and all-reduces it (256 B); XLA, given no constraint there (a slice of a whole
    value is not a resharding collective), sums the whole replicated gradient instead."""
    out = tmp_path / "report.json"
    env = dict(os.environ, TORCHALPA_XLA_DEVICES="4", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "jax_quickstart.py"),
                           "--dim", "64", "--batch", "64", "--layers", "2", "--steps", "2",
                           "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["max_param_diff"] < 1e-5
    np.testing.assert_allclose(report["losses"], report["reference_losses"], rtol=1e-5)
    # the plan reshards between ops, and the program XLA compiled says so
    assert report["constraints"] and not report["skipped"]
    planned = report["plan_collectives"]
    last_bias = 64 * 4                      # (64,) float32: the last layer's bias gradient
    bias_grads = [c for c in planned if c["phase"] == "backward" and c["kind"] == "all_reduce"
                  and c["bytes"] == last_bias]
    expected = [c for c in planned if c not in bias_grads]
    xla = report["collectives"]
    assert {k for k, r in xla.items() if r["xla_ops"]} == {c["kind"] for c in expected}
    for kind, row in xla.items():           # merged collectives count as their tensors
        mine = [c for c in expected if c["kind"] == kind]
        assert row["xla_tensors"] == len(mine), (kind, row, mine)
        assert row["xla_bytes"] == sum(c["bytes"] for c in mine), (kind, row, mine)
    assert len(bias_grads) <= 1
    # data parallelism: XLA all-reduces every gradient (merged or not) and the loss
    param_bytes = (64 * 256 + 256 + 256 * 64 + 64) * 4
    dp = report["dp_collectives"]
    assert dp["all_reduce"]["xla_tensors"] >= 2
    assert dp["all_reduce"]["xla_bytes"] == param_bytes + 4


class _MLP(torch.nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.ReLU(),
                                       torch.nn.Linear(4 * dim, dim), torch.nn.ReLU())

    def forward(self, x):
        return self.net(x)


def _shares(plan, node, mesh) -> int:
    """How many ways the plan splits ``node``'s work: the mesh axes its first result is
    sharded over, or is a partial sum over because an operand was sharded (a contracted
    dim), as passes/sharding/strategies.py counts ``shards``."""
    s = plan.strategy(node.name)
    return math.prod(mesh.shape[a] for a, p in enumerate(s.outputs[0])
                     if isinstance(p, Shard) or isinstance(p, Partial) and any(
                         i is not None and isinstance(i[a], Shard) for i in s.inputs))


def _per_device_compute(plan, graph, mesh, keep=lambda n: True) -> float:
    """The plan's compute estimate (passes/pricing/cost.py) summed over the ops ``keep`` selects."""
    from torchalpa.passes.pricing.cost import compute_cost, strategy_bytes

    def cost(n) -> float:
        s = plan.strategy(n.name)
        return compute_cost(mesh, n, _shares(plan, n, mesh), s.outputs,
                            strategy_bytes(graph, n, s.inputs, s.outputs, mesh.shape))
    return sum(cost(n) for n in graph.ops() if keep(n))


def _per_device_bytes(plan, graph, mesh, keep) -> float:
    """Bytes one device moves for the ops ``keep`` selects."""
    return sum(n.bytes / _shares(plan, n, mesh) for n in graph.ops() if keep(n))


@needs_torch_mlir
def test_export_and_cross_check_with_the_aten_plan():
    """The torch MLP planned from its ATen graph and from its StableHLO export: the same
    weight placements, estimates within 5%; with a plan, arguments carry mhlo.sharding."""
    from torchalpa.interop.programs import program_graph
    from torchalpa.parallel.workflow import capture_step
    torch.manual_seed(0)
    model, x, y = _MLP(64), torch.randn(64, 64), torch.randn(64, 64)
    loss_fn = torch.nn.functional.mse_loss
    text = torchalpa.export_stablehlo(model, (x, y), loss_fn)
    assert 'torchalpa.name = "net.0.weight"' in text
    mesh = Cluster.local_cpu(4).logical_mesh((4,))
    from_aten = torchalpa.plan(model, (x, y), loss_fn, cluster=mesh,
                               method=torchalpa.ShardParallel())
    from_text = torchalpa.plan(text, (), cluster=mesh, method=torchalpa.ShardParallel())
    assert from_text.unsupported_ops == ()
    weights = [p.name for p in from_aten.parameters if p.name.endswith("weight")]
    assert {n: from_text.parameter(n).placements for n in weights} == \
        {n: from_aten.parameter(n).placements for n in weights}
    # Same placements, so the same collectives; the matrix products cost the same. All of
    # the difference is in the memory-bound elementwise ops: XLA fuses the bias add into
    # the ReLU and mse's sub/square/mean into one kernel (torchalpa/core/fusion.py), eager
    # ATen runs each op alone. The step-time gap is exactly the per-device traffic of the
    # elementwise ops the ATen graph moves minus what the fused StableHLO graph moves.
    assert from_text.estimates.communication_s == pytest.approx(
        from_aten.estimates.communication_s, rel=1e-9)
    graph_aten = capture_step(model, (x, y), loss_fn).graph
    graph_text = program_graph(text, ())
    matmul = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}
    for plan, graph in ((from_aten, graph_aten), (from_text, graph_text)):
        assert _per_device_compute(plan, graph, mesh) == pytest.approx(
            plan.estimates.compute_s, rel=1e-9)       # the shares are read right
    products = [_per_device_compute(p, g, mesh, lambda n: n.op in matmul)
                for p, g in ((from_aten, graph_aten), (from_text, graph_text))]
    assert products[1] == pytest.approx(products[0], rel=1e-9)
    elementwise = [_per_device_compute(p, g, mesh, lambda n: n.op not in matmul)
                   for p, g in ((from_aten, graph_aten), (from_text, graph_text))]
    gap = from_aten.estimates.step_time_s - from_text.estimates.step_time_s
    assert gap == pytest.approx(elementwise[0] - elementwise[1], rel=1e-6)
    traffic = [_per_device_bytes(p, g, mesh, lambda n: n.op not in matmul)
               for p, g in ((from_aten, graph_aten), (from_text, graph_text))]
    assert 0 < traffic[1] < traffic[0]                   # fusion only ever moves less
    # ...and the bytes it does not move are the gap (fused ops keep only a few flops' time)
    assert gap == pytest.approx((traffic[0] - traffic[1]) / mesh.memory_bandwidth, rel=0.05)
    # ATen's mse_loss backward computes (x - y) a second time: one more live (B, d)
    # activation than torch.export's decomposition (6.5% of this small step's memory)
    assert from_text.estimates.memory_per_device_bytes == pytest.approx(
        from_aten.estimates.memory_per_device_bytes, rel=0.10)

    annotated = torchalpa.export_stablehlo(model, (x, y), loss_fn, plan=from_aten)
    from torchalpa.interop.hlo_annotate import hlo_sharding
    w = from_aten.parameter("net.0.weight")
    assert f'mhlo.sharding = "{hlo_sharding(w.placements, 2, (4,))}"' in annotated
    again = torchalpa.plan(annotated, (), cluster=mesh,
                           method=torchalpa.ShardParallel())      # still reads as a step
    assert [p.name for p in again.parameters] == [p.name for p in from_text.parameters]


@needs_torch_mlir
def test_gpt_from_stablehlo_moves_the_bytes_aten_does():
    """The tiny GPT (untied head, no dropout): with XLA's fusion and embeddings read as
    embeddings, its StableHLO graph moves within 5% of the bytes its ATen graph does, and
    has no op without a rule (the loss's target pick reads as aten.gather)."""
    from torchalpa import models
    from torchalpa.interop.programs import program_graph
    from torchalpa.parallel.workflow import capture_step
    w = models.tiny("gpt", dropout=0.0, attention="eager")   # both sides write it out
    model = w.build()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    batch = w.example_inputs()
    from_aten = capture_step(model, batch, w.loss_fn).graph
    from_text = program_graph(torchalpa.export_stablehlo(model, batch, w.loss_fn), ())
    moved = [sum(n.bytes for n in g.ops()) for g in (from_aten, from_text)]
    assert moved[1] == pytest.approx(moved[0], rel=0.05), moved
    assert {n.op for n in from_text.ops() if n.op.startswith("stablehlo.")} == set()
    assert sum(n.op == "aten.gather.default" for n in from_text.ops()) == 1
    assert sum(n.op == "aten.embedding.default" for n in from_text.ops()) == 2


class _TiedMLP(torch.nn.Module):
    """An MLP whose output layer reuses the input layer's weight, transposed (a tied head)."""

    def __init__(self, dim=8, hidden=16):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim, bias=False)
        self.tied = torch.nn.Linear(dim, hidden, bias=False)
        self.tied.weight = self.up.weight

    def forward(self, x):
        return self.tied(self.down(torch.relu(self.up(x))))


@needs_torch_mlir
def test_export_passes_a_tied_parameter_once_with_both_uses_in_its_gradient():
    """A tied parameter is one argument (its first name) whose gradient sums both uses:
    the StableHLO graph, run op by op, gives torch's loss and gradients."""
    torch.manual_seed(0)
    model, x, y = _TiedMLP(), torch.randn(4, 8), torch.randn(4, 16)
    loss_fn = torch.nn.functional.mse_loss
    text = torchalpa.export_stablehlo(model, (x, y), loss_fn)
    graph = from_stablehlo(text)
    assert sorted(graph.params) == ["down.weight", "up.bias", "up.weight"]
    leaves = {name: p.detach() for name, p in model.named_parameters()}
    leaves.update(input0=x, input1=y)
    loss, grads = _run_graph(graph, leaves)
    model.zero_grad()
    ref = loss_fn(model(x), y)
    ref.backward()
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_cli_plans_a_stablehlo_file(tmp_path, capsys):
    from torchalpa.cli.commands import main

    def loss(params, x):
        return jnp.mean(jnp.tanh(x @ params["w1"]) @ params["w2"])
    params, x = {"w1": jnp.ones((16, 32)), "w2": jnp.ones((32, 8))}, jnp.ones((64, 16))
    path = tmp_path / "step.mlir"
    path.write_text(lower_jax(loss, (params, x)).text)
    out = tmp_path / "plan.json"
    assert main(["plan", "--stablehlo", str(path), "--mesh", "2x2", "--preset", "local_cpu",
                 "--json", str(out)]) == 0
    assert "params.w1" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["mesh"]["shape"] == [2, 2] and set(saved["parameters"]) == {
        "params.w1", "params.w2"}
    with pytest.raises(SystemExit, match="--mesh must look like"):
        main(["plan", "--stablehlo", str(path), "--mesh", "2by2"])


def test_a_pick_of_one_element_per_row_reads_as_aten_gather():
    """Cross entropy's target pick (``take_along_axis``) and its gradient are ATen's
    gather and scatter_add with their rule, not ops without one (which would gather the
    whole logits on every device); the graph still computes JAX's loss and gradient."""
    def loss(params, x, y):
        logp = jax.nn.log_softmax(x @ params["w"], axis=-1)                # (B, V)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1, mode="clip"))
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)}
    x, y = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32), jnp.array([1, 5, 15, 0])
    lowered = lower_jax(loss, (params, x, y))
    graph = from_stablehlo(lowered.text, param_names=lowered.param_names,
                           input_names=lowered.input_names)
    ops = [n.op for n in graph.ops()]
    assert "aten.gather.default" in ops and "aten.scatter_add.default" in ops
    assert not [op for op in ops if op.startswith("stablehlo.")]
    pick = next(n for n in graph.ops() if n.op == "aten.gather.default")
    assert pick.args[1] == 1 and pick.output.shape == (4, 1)
    got_loss, grads = _run_graph(graph, {"params.w": torch.from_numpy(np.array(params["w"])),
                                         "x": torch.from_numpy(np.array(x)),
                                         "y": torch.from_numpy(np.array(y))})
    ref_loss, ref_grads = jax.value_and_grad(loss)(params, x, y)
    assert float(got_loss) == pytest.approx(float(ref_loss), rel=1e-5)
    np.testing.assert_allclose(grads["params.w"].numpy(), np.asarray(ref_grads["w"]),
                               rtol=1e-5, atol=1e-6)


class _Embedder(torch.nn.Module):
    """Token and position tables added, then a linear head: a BERT/LLaMA embedding stem."""

    def __init__(self, vocab=32, positions=6, dim=8):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, dim)
        self.positions = torch.nn.Embedding(positions, dim)
        self.head = torch.nn.Linear(dim, 4)

    def forward(self, ids):
        where = torch.arange(ids.shape[1])
        return self.head(torch.tanh(self.tokens(ids) + self.positions(where)).to(torch.float32))


@needs_torch_mlir
def test_embedding_gradients_read_as_aten_with_their_index_checks_inside():
    """torch-mlir clamps an embedding gradient's indices and masks rows out of range
    before its scatter; ATen's embedding_dense_backward does both inside the op. Read as
    ATen reads it: the gradient op takes the indices the lookup took and the rows
    unmasked, no same-type convert is left as a copy, and the graph still computes
    torch's loss and gradients."""
    torch.manual_seed(0)
    model, ids, y = _Embedder(), torch.randint(0, 32, (3, 6)), torch.randn(3, 6, 4)
    loss_fn = torch.nn.functional.mse_loss
    graph = from_stablehlo(torchalpa.export_stablehlo(model, (ids, y), loss_fn))
    backward = [n for n in graph.ops() if n.op == "aten.embedding_dense_backward.default"]
    lookups = [n for n in graph.ops() if n.op == "aten.embedding.default"]
    assert len(backward) == 2 and len(lookups) == 2
    for n in backward:
        grad, indices = (graph.node(r.node) for r in n.operands)
        assert grad.op != "aten.where.self" and indices.op != "aten.clamp.Tensor", n.name
        assert indices.name in {graph.node(m.operands[1].node).name for m in lookups}
    assert not [n for n in graph.ops() if n.op == "aten._to_copy.default"
                and graph.node(n.operands[0].node).outputs[0].dtype == n.outputs[0].dtype]
    leaves = {name: p.detach() for name, p in model.named_parameters()}
    leaves.update(input0=ids, input1=y)
    loss, grads = _run_graph(graph, leaves)
    model.zero_grad()
    ref = loss_fn(model(ids), y)
    ref.backward()
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_softmax_written_as_its_steps_splits_its_dim_with_a_max_all_reduce():
    """JAX's log-softmax is max, subtract, exp, sum, log: with the head split by vocabulary
    the max over the split dim is a Partial max made whole by one all-reduce(max) and the
    sum by one all-reduce(sum) -- the (batch, vocab) logits are never gathered."""
    def loss(params, x, onehot):
        logits = x @ params["head"]
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits, axis=-1) * onehot, axis=-1))
    rng = np.random.default_rng(0)
    params = {"head": jnp.asarray(rng.normal(size=(32, 4096)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
    onehot = jax.nn.one_hot(jnp.asarray(rng.integers(0, 4096, 64)), 4096)
    method = torchalpa.ShardParallel(auto_sharding_option=torchalpa.AutoShardingOption(
        pin={"params.head": ("S(1)",)}))
    plan = torchalpa.plan(loss, (params, x, onehot), cluster=Cluster.local_cpu(4).logical_mesh((4,)),
                          method=method)
    maxes = [c for c in plan.collectives if c.reduce_op == "max"]
    assert [(c.kind, c.phase) for c in maxes] == [("all_reduce", "forward")]
    assert maxes[0].bytes == 64 * 4                      # one max per row
    logits_bytes = 64 * 4096 * 4
    assert not [c for c in plan.collectives if c.kind == "all_gather"
                and c.bytes * 4 >= logits_bytes], plan.summary()


def test_with_jax_loaded_the_pipeline_search_forks_no_workers(monkeypatch):
    """Forking a process that runs XLA's threads can deadlock the child: with JAX
    imported (as here), the stage solves that would run in forked workers run in this
    process, and give the plan they give forked."""
    import multiprocessing

    import torch.nn.functional as F

    from torchalpa.passes.pipeline_search import inter_op
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from quickstart import MLP
    monkeypatch.setattr(inter_op, "cpu_workers", lambda: 2)     # as on a 2-core machine
    with torch.device("meta"):
        model, x, y = MLP(32, 4), torch.empty(64, 32), torch.empty(64, 32)
    method = torchalpa.PipeshardParallel(num_micro_batches=2,
                                         layer_option=torchalpa.AutoLayerOption(layer_num=2))
    forked = []
    monkeypatch.setattr(multiprocessing, "get_context", lambda *a: forked.append(a))
    monkeypatch.setenv("TORCHALPA_CACHE", "0")
    plan = torchalpa.plan(model, (x, y), F.mse_loss, method=method,
                          cluster=Cluster.local_cpu(2))
    assert forked == [] and plan.stages


def test_a_fused_qkv_written_in_jax_splits_by_heads():
    """``jnp.split(x @ w_qkv, 3)`` lowers to three slices; read together as one split, the
    fused weight is held as a strided shard (each device its heads of q, of k and of v),
    so attention runs split by heads with one all-reduce (the output projection's): Alpa's
    layout, whichever way q, k and v are spelled (``frontends/hlo_slices.py``)."""
    from torchalpa.core.cluster import LogicalMesh
    from torchalpa.core.placement import strided
    B, S, H, NH = 8, 16, 64, 4

    def loss(params, x):
        q, k, v = jnp.split(x @ params["qkv"], 3, axis=-1)
        heads = lambda t: t.reshape(B, S, NH, H // NH).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = heads(q), heads(k), heads(v)
        ctx = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2), axis=-1) @ v
        return jnp.mean((ctx.transpose(0, 2, 1, 3).reshape(B, S, H) @ params["out"]) ** 2)
    rng = np.random.default_rng(0)
    params = {"qkv": jnp.asarray(rng.normal(size=(H, 3 * H)), jnp.float32),
              "out": jnp.asarray(rng.normal(size=(H, H)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(B, S, H)), jnp.float32)
    plan = torchalpa.plan(loss, (params, x), cluster=LogicalMesh(shape=(4,)),
                          method=torchalpa.ShardParallel())
    placements = {p.name: p.placements for p in plan.parameters}
    assert placements == {"params.qkv": (strided(1, 3),), "params.out": (Shard(0),)}
    assert [(c.kind, c.phase, c.bytes) for c in plan.collectives] == [
        ("all_reduce", "forward", B * S * H * 4)]


def test_only_slices_tiling_a_dim_into_equal_pieces_read_as_a_split():
    """Unequal pieces, or pieces that leave part of the dim out, stay slices: a split of
    them would not be one strided layout."""
    def loss(w, x):
        y = x @ w                                             # (8, 96)
        return (jnp.sum(y[:, :40] ** 2) + jnp.sum(y[:, 40:] ** 2)     # unequal pieces
                + jnp.sum(y[:, 0:32] * y[:, 32:64]))                   # part of the dim
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(16, 96)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    lowered = lower_jax(loss, (w, x))
    graph = from_stablehlo(lowered.text, param_names=lowered.param_names,
                           input_names=lowered.input_names)
    ops = [n.op for n in graph.ops()]
    assert "aten.split_with_sizes.default" not in ops and ops.count("aten.slice.Tensor") >= 4
