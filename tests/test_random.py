"""Random ops that shard (passes/rules/random.py, runtime/lowering/random_draws.py) and ranks that cannot
drift (runtime/resilience/replicas.py, the generator sync in auto_parallel).

- the planner: dropout no longer gathers its input (BERT layers, data parallel);
- the per-block draw: the rate holds, blocks differ, replicas agree, seeds reproduce;
- on 4 gloo ranks (tests/random_worker.py): ranks seeded differently before wrapping keep
  bitwise-equal replicas; the replica check names a drifted generator or parameter; the
  same seed reproduces a run and the saved generator state resumes it bit-identically;
  ``random="replicated"`` trains like one device.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
import worker_io

import torchalpa
from torchalpa.core.options import AutoShardingOption
from torchalpa.core.placement import Replicate, Shard
from torchalpa.core.plan import NodeStrategy
from torchalpa.runtime.lowering import random_draws as R
from torchalpa.runtime.lowering.localize import localize
from torchalpa.runtime.resilience.replicas import bit_hash

aten = torch.ops.aten


# -- the planner ----------------------------------------------------------------------------

def _bert_layers_graph(dropout: float):
    """Alpa's BERT-layer data-parallel case: 2 layers, B64 S64 H32, as an OpGraph."""
    from torchalpa.frontends.torch_export import capture
    from torchalpa.models.bert import BertConfig, Layer

    class Layers(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))

        def forward(self, x, mask, y):
            for layer in self.layers:
                x = layer(x, mask)
            return ((x - y) ** 2).mean()

    cfg = BertConfig(hidden=32, num_heads=8, intermediate=128, num_layers=2, dropout=dropout)
    with torch.device("meta"):
        model = Layers(cfg)
        example = (torch.empty(64, 64, 32), torch.zeros(64, 1, 1, 64), torch.empty(64, 64, 32))
    return capture(model, example).graph


@pytest.fixture(scope="module")
def bert_plans():
    """On mesh (4, 1) with unit alpha-beta costs (the objective is in Alpa's units)."""
    from torchalpa.parallel.shard import plan_graph
    mesh = torchalpa.LogicalMesh(shape=(4, 1), alpha=(1.0, 1.0), beta=(1.0, 1.0))
    graphs = {p: _bert_layers_graph(p) for p in (0.1, 0.0)}
    return {(p, random): plan_graph(graphs[p], meshes=[mesh], method=torchalpa.ShardParallel(
        auto_sharding_option=AutoShardingOption(random=random)))
        for p, random in [(0.1, "sharded"), (0.0, "sharded"), (0.1, "replicated")]}


def test_dropout_does_not_gather_its_input(bert_plans):
    """Issue 14: with dropout 0.1 the plan is the dropout-0 plan (Alpa's 152,472 here is
    the gradients' all-reduce); drawing masks whole gathers every dropout input."""
    sharded, none, whole = (bert_plans[k] for k in
                            [(0.1, "sharded"), (0.0, "sharded"), (0.1, "replicated")])
    kinds = Counter(c.kind for c in sharded.collectives)
    assert "all_gather" not in kinds and kinds == Counter(c.kind for c in none.collectives)
    assert sharded.estimates.objective <= 1.001 * none.estimates.objective
    dropouts = [s for s in sharded.strategies if s.node.startswith("native_dropout")
                and "backward" not in s.node]
    assert len(dropouts) == 4 and all(s.outputs[0] == (Shard(0), Replicate()) for s in dropouts)
    assert any("4 random ops" in note for note in sharded.notes)
    assert not any("random ops" in note for note in whole.notes)
    # the single-device-numerics option keeps its (honest) price
    assert Counter(c.kind for c in whole.collectives)["all_gather"] == 4
    assert whole.estimates.objective > 5 * sharded.estimates.objective


def test_random_option_is_validated():
    with pytest.raises(ValueError, match="random must be 'sharded' or 'replicated'"):
        AutoShardingOption(random="per_rank")


# -- the per-block draw ---------------------------------------------------------------------

def _dropout_blocks(p: float, seed: int, blocks, shape=(64, 64, 32)):
    """Each block's (output, mask) of one dropout call, every rank from generator ``seed``."""
    x = torch.ones(shape)
    out = {}
    for block in blocks:
        torch.manual_seed(seed)            # every rank's generator is in the same state
        out[block] = R.dropout(x, p, block)
    return out


def test_sharded_dropout_keeps_its_rate_and_draws_a_mask_per_block():
    blocks = [(0, 0), (1, 0), (2, 0), (3, 0)]
    drawn = _dropout_blocks(0.1, 0, blocks + [(1, 0)])
    n = 64 * 64 * 32
    for block in blocks:
        out, mask = drawn[block]
        rate = 1 - mask.float().mean().item()
        assert abs(rate - 0.1) < 5 * (0.1 * 0.9 / n) ** 0.5, (block, rate)   # 5 sigma
        assert torch.equal(out, mask * (1 / 0.9))                            # x = ones
    masks = [drawn[b][1] for b in blocks]
    for i in range(len(masks)):
        for j in range(i + 1, len(masks)):
            agree = (masks[i] == masks[j]).float().mean().item()
            assert abs(agree - (0.1 ** 2 + 0.9 ** 2)) < 0.01, (i, j)         # independent
    # the same block drawn again from the same generator state: the same mask
    assert torch.equal(_dropout_blocks(0.1, 0, [(1, 0)])[(1, 0)][1], masks[1])


def test_each_call_draws_a_new_mask_and_seeds_reproduce():
    torch.manual_seed(3)
    first = [R.dropout(torch.ones(4096), 0.5, (1,))[1] for _ in range(2)]
    torch.manual_seed(3)
    again = [R.dropout(torch.ones(4096), 0.5, (1,))[1] for _ in range(2)]
    torch.manual_seed(4)
    other = R.dropout(torch.ones(4096), 0.5, (1,))[1]
    assert not torch.equal(first[0], first[1])          # the next call (or micro-batch)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other)


def test_dropout_edge_rates():
    x = torch.randn(1000)
    out, mask = R.dropout(x, 1.0, (0,))
    assert not mask.any() and not out.any()
    out, mask = R.dropout(x, 0.0, (0,))
    assert mask.all() and torch.equal(out, x)


def _traced_random_nodes():
    def fn(x):
        return (torch.rand(8, 6), aten.native_dropout(x, 0.25, True), torch.randint(3, 9, (8, 6)),
                x.clone().uniform_(), torch.randn_like(x),
                # the functional forms a functionalized training step holds
                aten.uniform(x, 0.5, 1.5), aten.exponential(x))
    from torchalpa.frontends.torch_export import trace_ops
    gm, _ = trace_ops(fn, (torch.randn(8, 6),))
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and str(n.target) in R.RANDOM_OPS]


@pytest.mark.parametrize("mesh_shape, placements, coords_list", [
    ((4,), (Shard(0),), [(0,), (1,), (2,), (3,)]),
    ((2, 2), (Shard(0), Replicate()), [(0, 0), (0, 1), (1, 0), (1, 1)]),
])
def test_localized_random_ops_draw_blocks_and_replicas_agree(mesh_shape, placements,
                                                             coords_list):
    """Lowered on each rank of a mesh: blocks have the local shape; ranks holding the same
    block (a replicated axis) draw the same numbers, different blocks different ones."""
    nodes = _traced_random_nodes()
    assert len(nodes) == 7
    x = torch.randn(8, 6)
    for node in nodes:
        num_in = sum(isinstance(a, torch.fx.Node) for a in node.args)
        strategy = NodeStrategy(node.name, tuple(placements for _ in range(num_in)),
                                tuple(placements for _ in range(2)))
        drawn = {}
        for coords in coords_list:
            rows = 8 // mesh_shape[0]
            local_x = x[coords[0] * rows:(coords[0] + 1) * rows]
            args = [local_x if isinstance(a, torch.fx.Node) else a for a in node.args]
            target, args, kwargs = localize(node, args, dict(node.kwargs), strategy, mesh_shape,
                                            torch.device("cpu"), coords)
            assert target.__wrapped__ in (R.draw, R.dropout), node.target
            torch.manual_seed(11)
            out = target(*args, **kwargs)
            out = out[1] if isinstance(out, tuple) else out
            assert out.shape[0] == rows, node.name
            drawn[coords] = out
        for a in coords_list:
            for b in coords_list:
                same_block = a[0] == b[0]
                assert torch.equal(drawn[a], drawn[b]) == same_block, (node.name, a, b)


def test_functional_random_fills_have_rules():
    """``empty_like(h).exponential_()`` and ``.uniform_(a, b)`` (PhiMoE's sparsemixer
    router) reach a captured training step as ``aten.exponential`` / ``aten.uniform``:
    each has a rule, so the planner may shard them like the other random ops."""
    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.rules import rule_for

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            h = self.lin(x)
            noise = torch.empty_like(h).exponential_().log()
            return ((h - noise) * torch.empty_like(h).uniform_(0.5, 1.5)).sum()
    graph = capture(Noisy(), (torch.randn(8, 6),)).graph
    random = [n for n in graph.ops() if n.op in ("aten.exponential.default",
                                                  "aten.uniform.default")]
    assert len(random) == 2
    for n in random:
        assert rule_for(n, graph) is not None, n.op
        assert n.op in R.RANDOM_OPS


def test_replicated_random_ops_are_not_rewritten():
    """A result replicated on every axis is drawn whole from the default generator, as on
    one device (so ``random="replicated"`` gives single-device numerics)."""
    for node in _traced_random_nodes():
        num_in = sum(isinstance(a, torch.fx.Node) for a in node.args)
        r = (Replicate(),)
        strategy = NodeStrategy(node.name, tuple(r for _ in range(num_in)), (r, r))
        target, _, _ = localize(node, list(node.args), dict(node.kwargs), strategy, (4,),
                                torch.device("cpu"), (2,))
        assert target is node.target


def test_bit_hash_sees_one_bit():
    x = torch.randn(100)
    y = x.clone()
    y.view(torch.int32)[57] ^= 1
    assert bit_hash(x) == bit_hash(x.clone())
    assert bit_hash(x) != bit_hash(y)
    assert bit_hash(torch.zeros(4)) != bit_hash(torch.zeros(2, 2))
    assert bit_hash(torch.tensor([True, False])) != bit_hash(torch.tensor([False, True]))


# -- on 4 gloo ranks --------------------------------------------------------------------------

def launch(nproc: int, scenarios: str, tmp_path) -> dict:
    results = worker_io.launch("random_worker.py", tmp_path / "random.json", scenarios,
                               nproc=nproc)
    assert results["world_size"] == nproc
    return results


get = worker_io.scenario       # results[name], or the test fails with the scenario's trace


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return launch(4, "per_rank_seeds_2d,detects_drift,reproducible",
                  tmp_path_factory.mktemp("random4"))


def test_ranks_seeded_differently_keep_bitwise_equal_replicas(four):
    """Issue 20: torch.manual_seed(rank) before wrapping; 3 Adam steps with dropout on a
    2x2 mesh, where some dropout results are replicated over an axis (whose replicas must
    draw the same mask). Without the generator sync, fc2.bias drifts by ~5e-2."""
    r = get(four, "per_rank_seeds_2d")
    assert r["warned"]
    assert r["replica_diffs"] and all(d == 0.0 for d in r["replica_diffs"].values()), \
        r["replica_diffs"]
    assert any("Replicate()" in p for p in r["dropout_placements"])


def test_replica_check_names_the_drifted_generator_and_parameter(four):
    r = get(four, "detects_drift")
    assert r["rng_error"] is not None and r["rng_name"] in r["rng_error"]
    assert "ranks [1] differ" in r["rng_error"]
    assert r["param_error"] is not None and "fc2.bias" in r["param_error"]
    assert "ranks [2] differ" in r["param_error"] and "fc1.weight" not in r["param_error"]


def test_same_seed_reproduces_and_the_generator_state_resumes_bit_identically(four):
    r = get(four, "reproducible")
    assert r["first"] == r["second"]
    assert r["resumed"] == r["second"][1:]
    assert r["other_seed"] != r["first"]


@pytest.mark.slow
def test_data_parallel_dropout_and_the_single_device_option(tmp_path):
    """Data parallel: sharded masks, replicas equal; random="replicated" draws the masks
    one device draws (losses equal up to summation order), the default draws others."""
    results = launch(4, "per_rank_seeds,random_replicated", tmp_path)
    r = get(results, "per_rank_seeds")
    assert all(d == 0.0 for d in r["replica_diffs"].values())
    assert r["dropout_placements"] == ["(Shard(0),)"] * 2
    r = get(results, "random_replicated")
    assert r["replicated_placements"] == ["(Replicate(),)"] * 2
    for got, want in zip(r["replicated"], r["ref"]):
        assert abs(got - want) <= 1e-6 * abs(want)
    assert abs(r["sharded"][0] - r["ref"][0]) > 1e-4 * abs(r["ref"][0])
