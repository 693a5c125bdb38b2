"""Alpa's AutoShardingOption knobs, each doing what it says on a small MLP."""

import pytest
import torch
from alpa_cases import MLPModuleList, mse

from torchalpa import (
    AutoShardingOption,
    LogicalMesh,
    ManualShardingOption,
    Replicate,
    Shard,
    ShardParallel,
)
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel.shard import blocks_of
from torchalpa.passes.sharding.intra_op import plan_intra_op

MESH = LogicalMesh(shape=(4,))
MESH_2D = LogicalMesh(shape=(2, 2), beta=(1.0, 0.1))


@pytest.fixture(scope="module")
def graph():
    with torch.device("meta"):
        model = MLPModuleList(4, 64, 64, 64)
        x = torch.empty(32, 64)
    return capture(model, (x, x), mse).graph


def _plan(graph, mesh=MESH, manual=None, **options):
    method = ShardParallel(auto_sharding_option=AutoShardingOption(**options),
                           manual_sharding_option=manual)
    return plan_intra_op(graph, mesh, method, blocks=blocks_of(graph))


def _kinds(plan):
    return {c.kind for c in plan.collectives}


def test_forbidden_collectives_are_not_used(graph):
    assert "all_gather" not in _kinds(_plan(graph, allow_all_gather=False))
    assert "all_to_all" not in _kinds(_plan(graph, MESH_2D, allow_all_to_all=False))


def test_no_replicated_parameters(graph):
    plan = _plan(graph, allow_replicated_parameters=False)
    assert all(p.placements != (Replicate(),) for p in plan.parameters)


def test_no_mixed_mesh_shape(graph):
    plan = _plan(graph, MESH_2D, allow_mixed_mesh_shape=False, allow_replicated_parameters=False)
    for s in plan.strategies:
        for layout in s.inputs + s.outputs:
            dims = [p.dim for p in layout or () if isinstance(p, Shard)]
            assert len(dims) == len(set(dims)), s


def test_simple_heuristic_is_never_better_than_the_ilp(graph):
    heuristic = _plan(graph, force_simple_heuristic="shard-largest")
    assert heuristic.estimates["objective"] >= _plan(graph).estimates["objective"] - 1e-6


def test_gradient_buckets_respect_the_threshold(graph):
    data_parallel = dict(force_batch_dim_to_mesh_dim=0, parameters="replicated")
    one = _plan(graph, all_reduce_threshold=1 << 60, **data_parallel)
    assert len(one.estimates["gradient_buckets"]) == 1
    small = _plan(graph, all_reduce_threshold=64 * 64 * 4, **data_parallel)
    buckets = small.estimates["gradient_buckets"]
    assert len(buckets) > 1 and all(b["bytes"] <= 64 * 64 * 4 for b in buckets)
    # one latency per bucket instead of one per gradient
    saved = sum(len(b["tensors"]) - 1 for b in buckets) * MESH.alpha[0]
    plain = _plan(graph, **data_parallel)
    assert small.estimates["step_time_s"] == pytest.approx(plain.estimates["step_time_s"] - saved)


def test_manual_sharding_without_search(graph):
    whole = _plan(graph, enable_auto_sharding=False)
    assert all(p.placements == (Replicate(),) for p in whole.parameters)
    assert not whole.collectives
    manual = ManualShardingOption(pin={r"layers[.]0[.]weight": "S(0)"})
    pinned = _plan(graph, manual=manual, enable_auto_sharding=False)
    assert pinned.parameter("layers.0.weight").placements == (Shard(0),)


def test_option_errors_name_the_field():
    with pytest.raises(ValueError, match="force_simple_heuristic"):
        AutoShardingOption(force_simple_heuristic="greedy")
    with pytest.raises(ValueError, match="all_reduce_threshold"):
        AutoShardingOption(all_reduce_threshold=-1)
