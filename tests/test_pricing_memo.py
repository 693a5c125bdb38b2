"""A ``PricingMemo`` (``passes/pipeline_search/pricing_memo.py``) changes how long planning takes, never a
plan: a solve given a memo that other solves filled makes the plan a solve with its own
makes; the memo answers a repeated key with the object it made, and stays bounded."""

from __future__ import annotations

from dataclasses import replace

from search_models import GB, small_cluster, small_gpt_graph

import torchalpa
from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
from torchalpa.passes.rules import rule_for
from torchalpa.passes.sharding.intra_op import plan_intra_op


def _cluster():
    return small_cluster(1, nodes=1, devices=4)


def _choices(plan):
    return [(v.node, v.placements) for v in plan.parameters + plan.inputs]


def test_a_shared_memo_plans_what_a_fresh_one_plans():
    graph = small_gpt_graph(num_layers=1)
    method = torchalpa.ShardParallel(
        auto_sharding_option=torchalpa.AutoShardingOption(solver="highs"))
    cluster = _cluster()
    mesh = cluster.logical_mesh((2, 2))
    shared = PricingMemo()
    plan_intra_op(graph, cluster.logical_mesh((4, 1)), method, memo=shared)   # other views
    cold = plan_intra_op(graph, mesh, method, memo=shared)     # fills this view's entries
    warm = plan_intra_op(graph, mesh, method, memo=shared)     # answered from them
    assert _choices(cold) and _choices(warm) == _choices(cold)
    assert warm.estimates.step_time_s == cold.estimates.step_time_s
    assert warm.estimates.memory_per_device_bytes == cold.estimates.memory_per_device_bytes

def test_memo_answers_a_key_once_and_keeps_its_bound():
    cluster = _cluster()
    memo = PricingMemo(max_meshes=2, max_entries=1)
    mesh = cluster.logical_mesh((2, 2))
    costs = memo.reshard_costs(mesh)
    # the memory budget does not change a price: the same prices for another budget
    assert memo.reshard_costs(replace(mesh, memory_per_device=2 * GB)) is costs
    assert memo.reshard_costs(mesh, allow_reduce_scatter=False) is not costs
    memo.reshard_costs(cluster.logical_mesh((4, 1)))          # a third view: (2, 2) leaves
    assert memo.reshard_costs(mesh) is not costs
    graph = small_gpt_graph(num_layers=1)
    rule = next(r for r in (rule_for(n, graph) for n in graph) if r is not None)
    found = memo.rule_strategies(rule, mesh, False)
    assert found and memo.rule_strategies(rule, mesh, False) is found
    memo.rule_strategies(rule, mesh, True)           # full at one entry: emptied first
    again = memo.rule_strategies(rule, mesh, False)
    assert again is not found and again == found
    assert memo.reachable(mesh.shape) is memo.reachable(mesh.shape)


def _bound_models(graph, meshes, method, memo_of, monkeypatch):
    """Per mesh, the arrays of the LP ``step_time_lower_bound`` hands HiGHS, with the
    memo ``memo_of(mesh)`` gives."""
    from torchalpa.passes.sharding import ilp_highs
    from torchalpa.passes.sharding.intra_op import step_time_lower_bound
    models, solve = [], ilp_highs.linear_optimum

    def recorded(model, **kw):
        models.append((list(model.names), list(model.cost), list(model.upper),
                       list(model.row_lower), list(model.row_upper), list(model.starts),
                       list(model.index), list(model.value)))
        return solve(model, **kw)
    with monkeypatch.context() as patched:
        patched.setattr(ilp_highs, "linear_optimum", recorded)
        bounds = [step_time_lower_bound(graph, mesh, method, memo=memo_of(mesh))
                  for mesh in meshes]
    return models, bounds


def test_a_shared_memo_builds_the_bounds_lps_a_fresh_one_builds(monkeypatch):
    """The LP bound of every view is the same model, column for column and row for row,
    whether its memo is fresh or filled by other views and another graph first (rules
    found by identity, leaves' strategies per shape, operands' layouts kept across
    views): what the bounds phase reuses from LP to LP changes no LP."""
    cluster = _cluster()
    meshes = [cluster.logical_mesh(s) for s in ((2, 2), (4, 1), (1, 4))]
    method = torchalpa.ShardParallel(
        auto_sharding_option=torchalpa.AutoShardingOption(solver="highs"))
    graph = small_gpt_graph(num_layers=2)
    fresh, fresh_bounds = _bound_models(graph, meshes, method, lambda m: PricingMemo(),
                                        monkeypatch)
    shared = PricingMemo()
    _bound_models(small_gpt_graph(num_layers=1), meshes[::-1], method, lambda m: shared,
                  monkeypatch)
    warm, warm_bounds = _bound_models(graph, meshes, method, lambda m: shared, monkeypatch)
    assert len(fresh) == len(meshes) and all(len(m[0]) > 100 for m in fresh)
    assert warm == fresh and warm_bounds == fresh_bounds


def test_leaves_strategies_are_made_once_per_shape():
    """``leaf_strategies`` through the memo: the same strategies as made directly, one
    list for tensors of one shape (whatever else differs), another for another shape."""
    from torchalpa.core.opgraph import TensorSpec
    from torchalpa.passes.sharding.strategies import leaf_strategies
    mesh = _cluster().logical_mesh((2, 2))
    memo = PricingMemo()
    a, b = TensorSpec((8, 4), "float32"), TensorSpec((8, 4), "bfloat16")
    found = memo.leaf_strategies(a, mesh)
    assert found == leaf_strategies(a, mesh) and memo.leaf_strategies(b, mesh) is found
    other = memo.leaf_strategies(TensorSpec((4, 8), "float32"), mesh)
    assert other is not found and other == leaf_strategies(TensorSpec((4, 8), "float32"), mesh)
    assert memo.leaf_strategies(a, mesh, ((2, 8),)) is not found
