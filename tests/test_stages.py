"""Alpa's stage-construction DP against brute force, and its expected behaviours."""

from __future__ import annotations

import math
import random

import pytest

from torchalpa.passes.pipeline_search.stages import brute_force, stage_dp, submesh_shapes


def test_submesh_shapes_are_alpas():
    assert submesh_shapes(2, 4) == [(1, 1), (1, 2), (1, 4), (2, 4)]
    assert submesh_shapes(1, 8) == [(1, 1), (1, 2), (1, 4), (1, 8)]
    assert submesh_shapes(3, 2) == [(1, 1), (1, 2), (2, 2), (3, 2)]


def random_costs(num_layers, shapes, seed, memory_limit=None):
    rng = random.Random(seed)
    work = [rng.uniform(1, 3) for _ in range(num_layers)]
    eff = {j: rng.uniform(0.6, 1.0) for j in range(len(shapes))}

    def cost(k, i, j, after):
        n = shapes[j][0] * shapes[j][1]
        if memory_limit is not None and (i - k + 1) * (after + 1) > memory_limit * n:
            return math.inf
        return sum(work[k:i + 1]) / (n * eff[j]) + 0.1 * (shapes[j][0] > 1)
    return cost


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("layers,nodes,devices,micro", [(4, 1, 4, 4), (5, 2, 2, 8), (3, 2, 4, 2)])
def test_dp_equals_brute_force(seed, layers, nodes, devices, micro):
    shapes = submesh_shapes(nodes, devices)
    cost = random_costs(layers, shapes, seed, memory_limit=2 if seed % 2 else None)
    expected = brute_force(layers, nodes, devices, micro, cost)
    if math.isinf(expected):
        with pytest.raises(ValueError):
            stage_dp(layers, nodes, devices, micro, cost)
        return
    got = stage_dp(layers, nodes, devices, micro, cost)
    assert got.total == pytest.approx(expected)
    # the stages tile the layers and the devices
    assert got.stages[0].layers[0] == 0 and got.stages[-1].layers[1] == layers - 1
    assert sum(s.submesh[0] * s.submesh[1] for s in got.stages) == nodes * devices


def test_identical_layers_give_balanced_stages():
    """8 identical layers on a (2, 4) cluster with many micro-batches: equal stages."""
    shapes = submesh_shapes(2, 4)

    def cost(k, i, j, after):
        n = shapes[j][0] * shapes[j][1]
        # a bit of intra-op overhead: splitting a layer more ways is less efficient
        return (i - k + 1) * (1.0 / n + 0.02 * n)
    got = stage_dp(8, 2, 4, 16, cost)
    lengths = {s.layers[1] - s.layers[0] + 1 for s in got.stages}
    latencies = [s.latency for s in got.stages]
    assert len(lengths) == 1
    assert max(latencies) == pytest.approx(min(latencies))


def test_slow_links_keep_stages_inside_nodes():
    """If a stage on a submesh spanning nodes pays a large penalty, no stage spans nodes."""
    shapes = submesh_shapes(2, 4)

    def cost(k, i, j, after):
        n_nodes, m = shapes[j]
        return (i - k + 1) / (n_nodes * m) + (100.0 if n_nodes > 1 else 0.0)
    got = stage_dp(8, 2, 4, 8, cost)
    assert all(s.submesh[0] == 1 for s in got.stages)


def test_pruning_stops_early_without_changing_the_answer():
    shapes = submesh_shapes(2, 4)
    cost = random_costs(6, shapes, 3)
    got = stage_dp(6, 2, 4, 64, cost)
    assert got.total == pytest.approx(brute_force(6, 2, 4, 64, cost))
    distinct = len({cost(k, i, j, s) for k in range(6) for i in range(k, 6)
                    for j in range(len(shapes)) for s in range(6)})
    assert got.num_t_max_tried < distinct


# -- stage_option="profile": the DP on measured layer times --------------------------------

@pytest.fixture(scope="module")
def mlp_graph():
    import torch
    import torch.nn.functional as F
    from models import MLP

    from torchalpa.frontends.torch_export import capture
    with torch.device("meta"):
        model = MLP(64, 4)
        x, y = torch.empty(32, 64), torch.empty(32, 64)
    return capture(model, (x, y), F.mse_loss).graph


def _profile_method():
    import torchalpa
    return torchalpa.PipeshardParallel(num_micro_batches=4, stage_option="profile",
                                       layer_option=torchalpa.AutoLayerOption(layer_num=4))


def test_profile_needs_measurements(mlp_graph):
    import torchalpa
    from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
    with pytest.raises(ValueError, match="torchrun"):
        plan_pipeline(mlp_graph, torchalpa.Cluster.local_cpu(4), _profile_method())


@pytest.fixture(scope="module")
def mlp_probes(mlp_graph):
    """The layer probes of ``mlp_graph`` on 4 CPU devices (an ILP per layer and view),
    built once for the tests below: they only read them."""
    import torchalpa
    from torchalpa.passes.pipeline_search.inter_op import layer_probes
    return layer_probes(mlp_graph, torchalpa.Cluster.local_cpu(4), _profile_method())


def test_probes_cover_every_layer_on_every_view_once(mlp_probes):
    from torchalpa.passes.pipeline_search.inter_op import logical_views
    probes = mlp_probes
    keys = [p.key for p in probes]
    assert len(keys) == len(set(keys))
    views = {(view, sub) for sub in submesh_shapes(1, 4) for view in logical_views(sub)}
    assert {(k[1], k[2]) for k in keys} == views
    for p in probes:      # the probe's stage holds exactly its layer, on its view
        stage = p.plan.stages[p.stage]
        assert stage.layers == (p.layer,) and stage.plan.mesh_shape == p.key[1]


@pytest.mark.parametrize("fast", [(1, 1), (1, 4)])
def test_measured_times_decide_the_stages(mlp_graph, mlp_probes, fast):
    """Whatever the cost model says, measurements that make one submesh far faster than
    the others make the DP use it: four 1-device stages, or one stage on all four."""
    import torchalpa
    from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
    cluster = torchalpa.Cluster.local_cpu(4)
    method = _profile_method()
    measured = {p.key: (1e-3 if p.key[2] == fast else 1.0) for p in mlp_probes}
    plan = plan_pipeline(mlp_graph, cluster, method, measured=measured)
    assert set(plan.submesh_shapes) == {fast}
    assert plan.estimates["stage_times"] == "measured"
    assert plan.stage_options == [{}] * len(plan.stages)     # every stage fits as it is
    assert "stage_options = " in plan.summary() and "stage_options" in plan.to_dict()
    per_stage = [len(s.layers) * 1e-3 for s in plan.stages]
    assert plan.estimates["stage_step_s"] == pytest.approx(per_stage)


def test_every_view_with_a_tensor_parallel_axis_within_a_node():
    """A submesh is tried as 1D and as (devices / tp, tp) for every tp dividing a node's
    devices, so each hand (dp, tp) grid's layout is among the views the search plans."""
    from torchalpa.passes.pipeline_search.inter_op import logical_views
    assert logical_views((1, 1)) == [(1,)]
    assert logical_views((1, 2)) == [(2,)]
    assert logical_views((1, 8)) == [(8,), (4, 2), (2, 4)]
    assert logical_views((2, 8)) == [(16,), (8, 2), (4, 4), (2, 8)]


def test_views_whose_axis_divides_no_dim_are_skipped():
    """An axis that can shard nothing (49 devices, dims 8 and 5120) only repeats work: the
    pipeline search does not solve it; views with a usable axis stay."""
    from torchalpa.passes.pipeline_search.inter_op import logical_views, shardable_views
    dims = frozenset({8, 4096, 5120})
    assert logical_views((49, 4)) == [(196,), (98, 2), (49, 4)]
    assert shardable_views((49, 4), dims) == []
    assert shardable_views((5, 4), dims) == [(20,), (10, 2), (5, 4)]  # 20, 10, 5 divide 5120
    assert shardable_views((5, 4), frozenset({8, 15})) == [(5, 4)]   # 20, 10 divide no dim
    assert shardable_views((2, 4), dims) == [(8,), (4, 2), (2, 4)]
    assert shardable_views((1, 1), dims) == [(1,)]


# -- the bound scan and the vectorized DP against the plain scan ----------------------------

def _plain_scan(num_layers, num_nodes, devices_per_node, micro, cost, epsilon=1e-9):
    """Alpa's scan as written before: the DP by explicit loops, run for every spaced bound
    in ascending order until (B - 1) * t_max reaches the best total."""
    import numpy as np

    from torchalpa.passes.pipeline_search import stages as st
    shapes = submesh_shapes(num_nodes, devices_per_node)
    sizes = np.array([n * m for n, m in shapes])
    D, L, J = num_nodes * devices_per_node, num_layers, len(shapes)
    S = min(L, D)
    C = st._cost_table(L, J, S, cost)
    best, last = None, -math.inf
    for t_max in np.unique(C[np.isfinite(C)]):
        if best is not None and (micro - 1) * t_max >= best[0]:
            break
        if t_max - last <= epsilon * max(1.0, abs(t_max)):
            continue
        last = t_max
        F = np.full((S + 1, L + 1, D + 1), np.inf)
        choice = np.full((S + 1, L + 1, D + 1, 2), -1, dtype=np.int64)
        F[0, L, 0] = 0.0
        allowed = np.where(C <= t_max, C, np.inf)
        for s in range(1, S + 1):
            for k in range(L - 1, -1, -1):
                row = F[s, k]
                for i in range(k, L):
                    for j in range(J):
                        c = allowed[k, i, j, s - 1]
                        if not math.isfinite(c):
                            continue
                        cand = c + F[s - 1, i + 1][: D + 1 - sizes[j]]
                        better = cand < row[sizes[j]:]
                        row[sizes[j]:] = np.where(better, cand, row[sizes[j]:])
                        idx = np.flatnonzero(better) + sizes[j]
                        choice[s, k, idx] = (i, j)
        totals = F[1:, 0, D]
        if not np.isfinite(totals).any():
            continue
        s, k, d, stages = int(np.argmin(totals)) + 1, 0, D, []
        while s > 0:
            i, j = choice[s, k, d]
            stages.append(((k, int(i)), shapes[j], float(allowed[k, i, j, s - 1])))
            k, d, s = int(i) + 1, d - int(sizes[j]), s - 1
        total = float(F[len(stages), 0, D]) + (micro - 1) * max(x[2] for x in stages)
        if best is None or total < best[0]:
            best = (total, stages)
    return best


def _tied_costs(num_layers, shapes, seed, memory_limit):
    """Costs on a coarse grid (many exact ties between pipelines), some pairs of values a
    hair apart (within the scan's epsilon), some ranges too big to fit."""
    rng = random.Random(seed)
    work = [rng.choice([1.0, 1.0, 2.0]) for _ in range(num_layers)]

    def cost(k, i, j, after):
        n = shapes[j][0] * shapes[j][1]
        if (i - k + 1) * (after + 1) > memory_limit * n:
            return math.inf
        value = round(sum(work[k:i + 1]) / n, 1) + 0.25 * (shapes[j][0] > 1)
        return value + (1e-12 if (k + j) % 3 == 0 else 0.0)
    return cost


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("layers,nodes,devices,micro",
                         [(6, 2, 4, 16), (7, 1, 8, 64), (5, 3, 2, 4), (8, 2, 2, 32)])
def test_bound_scan_gives_the_plain_scans_pipeline(seed, layers, nodes, devices, micro):
    """Same total and the very same stages (ties included) as the plain scan, with no
    more DP runs than bounds the plain scan ran."""
    shapes = submesh_shapes(nodes, devices)
    for cost in (random_costs(layers, shapes, seed, memory_limit=2 if seed % 2 else None),
                 _tied_costs(layers, shapes, seed, memory_limit=1 + seed % 3)):
        expected = _plain_scan(layers, nodes, devices, micro, cost)
        if expected is None:
            with pytest.raises(ValueError):
                stage_dp(layers, nodes, devices, micro, cost)
            continue
        got = stage_dp(layers, nodes, devices, micro, cost)
        assert got.total == expected[0]
        assert [(s.layers, s.submesh, s.latency) for s in got.stages] == expected[1]
