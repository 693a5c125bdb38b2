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
    assert heuristic.estimates.objective >= _plan(graph).estimates.objective - 1e-6


def test_gradient_buckets_respect_the_threshold(graph):
    data_parallel = dict(force_batch_dim_to_mesh_dim=0, parameters="replicated")
    one = _plan(graph, all_reduce_threshold=1 << 60, **data_parallel)
    assert len(one.estimates.gradient_buckets) == 1
    small = _plan(graph, all_reduce_threshold=64 * 64 * 4, **data_parallel)
    buckets = small.estimates.gradient_buckets
    assert len(buckets) > 1 and all(b["bytes"] <= 64 * 64 * 4 for b in buckets)
    # one latency per bucket instead of one per gradient
    saved = sum(len(b["tensors"]) - 1 for b in buckets) * MESH.alpha[0]
    plain = _plan(graph, **data_parallel)
    assert small.estimates.step_time_s == pytest.approx(plain.estimates.step_time_s - saved)


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


@pytest.mark.parametrize("options,names", [
    (dict(parameters="replicated", allow_replicated_parameters=False),
     "parameters='replicated'.*allow_replicated_parameters=False"),
    (dict(parameters="sharded", force_data_parallel=True),
     "force_data_parallel=True.*parameters='sharded'"),
    (dict(parameters="sharded", allow_all_gather=False, force_batch_dim_to_mesh_dim=-1),
     "parameters='sharded'.*allow_all_gather=False"),
])
def test_contradicting_options_name_both_knobs(options, names):
    """Combinations that contradict themselves are refused where the method is made (they
    used to fail in the solver: an IndexError, or 'two fixed layouts cannot be
    connected')."""
    with pytest.raises(ValueError, match=names):
        ShardParallel(auto_sharding_option=AutoShardingOption(**options))


def test_zero_presets_refuse_no_all_gather():
    from dataclasses import replace

    from torchalpa import Zero2Parallel
    option = replace(Zero2Parallel().auto_sharding_option, allow_all_gather=False)
    with pytest.raises(ValueError, match="allow_all_gather=False"):
        Zero2Parallel(auto_sharding_option=option)


# -- combinations Alpa's auto-sharding pass rejects ----------------------------------------------

@pytest.fixture(scope="module")
def odd_batch_graph():
    """A batch of 15 rows: it divides by no mesh axis of 2 or 4 devices."""
    with torch.device("meta"):
        model = MLPModuleList(2, 64, 64, 64)
        x = torch.empty(15, 64)
    return capture(model, (x, x), mse).graph


@pytest.mark.parametrize("shape,options,match", [
    ((4, 1), dict(force_batch_dim_to_mesh_dim=0), r"batch dim \(15\) must divide by 4 devices"),
    ((2, 2), dict(force_batch_dim_to_mesh_dim=1), r"batch dim \(15\) must divide by 2 devices"),
    # Alpa's force_data_parallel: the mesh flattened, the batch forced over all of it
    ((2, 2), dict(force_data_parallel=True), r"batch dim \(15\) must divide by 4 devices"),
    ((4,), dict(force_batch_dim_to_mesh_dim=1), r"force_batch_dim_to_mesh_dim=1 but the mesh has 1"),
])
def test_alpas_rejections_are_rejected_in_one_line(odd_batch_graph, shape, options, match):
    """Alpa's pass refuses a batch dim forced onto a mesh axis it does not divide ("The
    length of batch dimension is not divisible by the number of devices", its
    ``FilterStrategy``), also under ``force_data_parallel``, which forces it onto the
    flattened mesh; and an axis the mesh lacks (an out-of-range mesh dim there). Ours
    refuses the same with one line naming the problem and the fix."""
    mesh = LogicalMesh(shape=shape)
    with pytest.raises(ValueError, match=match) as refused:
        _plan(odd_batch_graph, mesh, **options)
    assert "\n" not in str(refused.value)


def test_alpas_zero3_options_are_accepted(graph):
    """What Alpa accepts is accepted: its force_zero_stage_3 turns all-gathers off in the
    ILP and still gathers the rewritten parameters (``prefer_reduce_scatter``); spelled so
    here, with all-gathers forbidden outright, the plan gathers the parameters it stores
    split and nothing else."""
    plan = _plan(graph, MESH_2D, force_data_parallel=True, prefer_reduce_scatter=True,
                 allow_all_gather=False, allow_reduce_scatter=False)
    assert plan.mesh_shape == (4,)
    assert _kinds(plan) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert all(c.bytes == 4 for c in plan.collectives if c.kind == "all_reduce")   # the loss
    assert all(p.placements == (Shard(0),) for p in plan.parameters)
