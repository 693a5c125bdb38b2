"""A plan found before as the ILP's start (passes/sharding/plan_start.py): what it maps back
to, that HiGHS receives it, and that the solve from it is as good as a cold one."""

from __future__ import annotations

import dataclasses

import pytest
from search_models import meta_tiny_gpt

import torchalpa
from torchalpa.core.options import AutoShardingOption, ShardParallel
from torchalpa.frontends.torch_export import capture
from torchalpa.passes.sharding import ilp_highs, intra_op
from torchalpa.passes.sharding.plan_start import start_choice


@pytest.fixture(scope="module")
def graph():
    model, batch, loss_fn = meta_tiny_gpt()
    return capture(model, batch, loss_fn).graph


def _mesh():
    cluster = dataclasses.replace(torchalpa.Cluster.h100(1, 4), host_op_s=0.0)
    return cluster.logical_mesh((2, 2))


def _method(**option):
    return ShardParallel(auto_sharding_option=AutoShardingOption(**option))


def test_a_plan_maps_back_to_strategies_with_its_layouts(graph):
    mesh = _mesh()
    plan = intra_op.plan_intra_op(graph, mesh, _method())
    space = intra_op.build_strategies(graph, mesh)
    choice = start_choice(plan, space.strategies)
    placed = {s.node: s for s in plan.strategies}
    assert choice, "no node of the plan mapped back"
    assert len(choice) >= 0.9 * len(placed)
    for node, s in choice.items():
        assert s in space.strategies[node]
        assert (s.inputs, s.outputs) == (placed[node].inputs, placed[node].outputs)


def test_a_solve_from_a_plan_found_within_a_gap_is_as_good_as_a_cold_one(graph, monkeypatch):
    """The re-solve at the solver's own gap from the plan found within 10 %: HiGHS gets that
    plan as its start, and the objective is the cold solve's to the solver's gap."""
    mesh = _mesh()
    coarse = intra_op.plan_intra_op(graph, mesh, _method(gap=0.1))
    solve, starts = ilp_highs.solve_with_highs, []

    def recorded(model, **kwargs):
        starts.append(len(model.initial or {}))
        return solve(model, **kwargs)

    monkeypatch.setattr(ilp_highs, "solve_with_highs", recorded)
    cold = intra_op.plan_intra_op(graph, mesh, _method())
    assert starts and starts[0] == 0
    starts.clear()
    warm = intra_op.plan_intra_op(graph, mesh, _method(), start_from=coarse)
    assert starts and starts[0] > 0
    best = min(cold.estimates.objective, warm.estimates.objective)
    assert warm.estimates.objective <= best * (1 + 1e-4) + 1e-12
    assert cold.estimates.objective <= best * (1 + 1e-4) + 1e-12
