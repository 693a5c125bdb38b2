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
