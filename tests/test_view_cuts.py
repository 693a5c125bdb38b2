"""Views cut by their LP bounds (torchalpa/parallel/view_cuts.py, AutoParallel's
``SearchSwitches.view_bounds``): the bound of the problems a view's ILP solves with the graph's
blocks is below that view's plan and no lower than the unsimplified one; the cut rule is the
one whole candidates are cut by; a view cut where it would be solved could not have won; the
search plans as it does without the cuts, and names the views it cut."""

from __future__ import annotations

import dataclasses
import json

import pytest
from search_models import meta_tiny_gpt

import torchalpa
from torchalpa.core.options import AutoShardingOption, ShardParallel
from torchalpa.core.switches import SearchSwitches
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel import auto, shard
from torchalpa.parallel.view_cuts import LP_CUT, Cutoff, ViewBound, ViewsCut, cut_views
from torchalpa.passes.sharding.intra_op import plan_intra_op, step_time_lower_bound

BIG_PATH = AutoShardingOption(exact_below=0, free_followers_below=0)
"""The path of a graph too big to solve unsimplified (target a's): blocks share decisions."""


@pytest.fixture(scope="module")
def gpt():
    return meta_tiny_gpt()


def _cluster(nodes: int = 1, devices: int = 4) -> torchalpa.Cluster:
    # the host's time per op left out, as in test_auto.py
    return dataclasses.replace(torchalpa.Cluster.h100(nodes, devices), host_op_s=0.0)


def test_the_bound_with_blocks_is_between_the_unsimplified_bound_and_the_plan(gpt):
    model, batch, loss_fn = gpt
    graph = capture(model, batch, loss_fn).graph
    blocks = shard.blocks_of(graph)
    assert blocks
    method = ShardParallel(num_micro_batches=2, auto_sharding_option=BIG_PATH)
    for mesh in shard.candidate_meshes(_cluster(), method):
        plan = plan_intra_op(graph, mesh, method, blocks=blocks)
        grouped = step_time_lower_bound(graph, mesh, method, blocks=blocks)
        plain = step_time_lower_bound(graph, mesh, method)
        assert grouped is not None and plain is not None
        assert plain <= grouped * (1 + 1e-9)
        assert grouped <= plan.estimates.step_time_s * (1 + 1e-9), (mesh.shape, grouped)


def test_a_view_is_cut_where_its_bound_cannot_beat_the_plan_by_the_tolerance():
    bounds = [ViewBound(0, 1.0), ViewBound(1, 0.995), ViewBound(2, 0.98), ViewBound(3, None)]
    cut = cut_views(bounds, Cutoff(best_s=1.0, tolerance=0.01))
    assert set(cut) == {0, 1}          # 0.98 * 1.01 < 1: it could win by the tolerance
    assert all(why.startswith(LP_CUT) and may_fit for why, may_fit in cut.values())
    assert cut_views(bounds, Cutoff(best_s=1.0, tolerance=0.0)) == {0: cut[0]}


@pytest.mark.parametrize("workers", [1, 2])
def test_a_view_cut_where_it_is_solved_could_not_have_won(gpt, workers, monkeypatch):
    """``plan_graph(cutoff=)`` bounds each view where it would solve it (in its worker with
    two): a view it cuts has a bound no better than the cutoff by the tolerance, and its
    plan solved uncut is no better either; the views it keeps are planned as without the
    cutoff; with no view left, ``ViewsCut`` names the views cut."""
    monkeypatch.setenv("TORCHALPA_CACHE", "0")      # a cached plan is taken unbounded
    model, batch, loss_fn = gpt
    graph = capture(model, batch, loss_fn).graph
    blocks = shard.blocks_of(graph)
    method = ShardParallel(num_micro_batches=2, auto_sharding_option=BIG_PATH)
    meshes = shard.candidate_meshes(_cluster(), method)
    assert len(meshes) >= 2
    alone = {i: plan_intra_op(graph, mesh, method, blocks=blocks).estimates.step_time_s
             for i, mesh in enumerate(meshes)}
    ranked = sorted(alone.values())
    # between the best view and the next: the best is kept, the others may be cut
    cutoff = Cutoff(best_s=(ranked[0] + ranked[1]) / 2, tolerance=0.0)
    bounds: dict = {}
    plan = shard.plan_graph(graph, method=method, meshes=meshes, blocks=blocks,
                            bound_views=False, workers=workers, cutoff=cutoff, bounds=bounds)
    assert set(bounds) == set(range(len(meshes)))          # every view bounded once
    assert plan.estimates.step_time_s == ranked[0]         # the winner is not cut
    cut = [i for i, b in bounds.items() if cutoff.cuts(b)]
    for i in cut:
        assert alone[i] * (1 + cutoff.tolerance) >= cutoff.best_s, (i, alone[i])
        assert bounds[i].seconds <= alone[i] * (1 + 1e-9)
    assert any(LP_CUT in n for n in plan.notes) == bool(cut)
    with pytest.raises(ViewsCut) as e:
        shard.plan_graph(graph, method=method, meshes=meshes, blocks=blocks, bound_views=False,
                         workers=workers, cutoff=Cutoff(best_s=ranked[0] * 0.5, tolerance=0.0))
    assert set(e.value.cut) == set(range(len(meshes)))


def test_the_search_cut_by_lp_bounds_plans_as_the_uncut_search(gpt, monkeypatch):
    """Two candidates on 2 nodes x 2 (dominance off, so the second is solved): with a plan
    in hand the second's views are bounded first; the plan is the one without bounds."""
    model, batch, loss_fn = gpt
    monkeypatch.setenv("TORCHALPA_CACHE", "0")
    monkeypatch.setattr(auto, "ROOM", 0.0)
    method = torchalpa.AutoParallel(pipeline=False, remat=("none",), num_micro_batches=1)
    plans = {}
    for bounded in (True, False):
        with SearchSwitches.using(view_bounds=bounded):
            plans[bounded] = torchalpa.plan(model, batch, loss_fn, cluster=_cluster(2, 2),
                                            method=method)

    def data(plan) -> dict:
        d = json.loads(plan.to_json())
        d.pop("notes")
        d["estimates"] = {k: v for k, v in d["estimates"].items() if "second" not in k}
        return d

    assert data(plans[True]) == data(plans[False])
    assert any("LP bounds: 2 views bounded" in n for n in plans[True].notes)
    assert not any("LP bounds" in n for n in plans[False].notes)


def test_views_cut_by_their_lp_bounds_are_named_in_the_notes(gpt, monkeypatch):
    monkeypatch.setenv("TORCHALPA_CACHE", "0")      # a cached plan is taken unbounded
    model, batch, loss_fn = gpt
    with SearchSwitches.using(view_bounds=True):
        cluster = _cluster()
        method = torchalpa.AutoParallel(pipeline=False, remat=("none",), num_micro_batches=1)
        meshes = shard.candidate_meshes(cluster, ShardParallel())
        search = auto.SearchSession(model, batch, loss_fn, method=method, cluster=cluster,
                                    meshes=meshes, allow_pipeline=False)._search
        c = auto.Candidate("intra-op", "none", 1, 0.0, 0.0)
        assert search.cutoff(c, None) is None                 # no plan in hand: no bound
        with SearchSwitches.using(view_bounds=False):
            assert search.cutoff(c, (1.0,)) is None
        assert search.solve(c, cutoff=search.cutoff(c, (1e3,))) is not None   # a slow plan
        assert search.bounded_views == len(meshes) and not search.cut
        with pytest.raises(ViewsCut):
            search.solve(c, {0: ("settled", True)}, search.cutoff(c, (1e-9,)))
        assert search.bounded_views == 2 * len(meshes) - 1   # the settled view is not bounded
        assert search.cut[c] == list(range(1, len(meshes)))
        shapes = ", ".join("x".join(map(str, m.shape)) for m in meshes[1:])
        assert search.cut_note() == f"{auto.LP_CUT_NOTE}{c.describe()} on {shapes}"
        # a candidate that only adds work to c is settled where c was cut, unbounded
        more = auto.Candidate("intra-op", "full", 2, 0.0, 0.0, regather=True)
        search.views = []             # (the plans solved above would settle it by room)
        settled = search.settled_views(more)
        assert set(settled) == set(range(1, len(meshes)))
        assert all(LP_CUT in why and c.describe() in why for why, _ in settled.values())
        assert search.settled_views(dataclasses.replace(c, remat="selective")) == settled
        # ... and one that does less than a candidate cut is not
        search.cut = {more: [0]}
        assert search.settled_views(c) == {}
