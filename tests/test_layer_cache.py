"""The pipeline search's solve cache: structural layer keys and cached vs uncached plans."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


class Blocks(nn.Module):
    """Linear + ReLU blocks with a pipeline boundary after each; ``widths`` gives each
    block's output width, so equal widths make identical layers."""

    def __init__(self, hidden: int, widths: list[int]):
        super().__init__()
        dims = [hidden, *widths]
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.ReLU())
                                    for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        from torchalpa.ops.markers import mark_pipeline_boundary
        for n, block in enumerate(self.blocks):
            x = block(x)
            if n < len(self.blocks) - 1:
                x = mark_pipeline_boundary(x)
        return x


def _graph(widths: list[int]):
    from torchalpa.frontends.torch_export import capture
    hidden = widths[-1]
    with torch.device("meta"):
        model = Blocks(hidden, widths)
        x, y = torch.empty(16, hidden), torch.empty(16, hidden)
    return capture(model, (x, y), F.mse_loss).graph


def _signatures(graph):
    from torchalpa.passes.pipeline_search.layer_cache import layer_signatures
    from torchalpa.passes.pipeline_search.layers import layers_from_markers
    layer = layers_from_markers(graph)
    assert layer is not None
    return layer_signatures(graph, layer, max(layer.values()) + 1)


def test_identical_layers_share_a_key_and_different_ones_do_not():
    sig = _signatures(_graph([32, 32, 32, 32]))
    assert len(sig) == 4
    assert sig[1] == sig[2]                 # middle blocks: same ops, shapes, edges
    assert sig[0] != sig[1]                 # the first reads the input, not a boundary
    assert sig[3] != sig[2]                 # the last feeds the loss
    wider = _signatures(_graph([32, 32, 48, 32]))
    assert wider[1] == sig[1]               # still 32 -> 32, reading and sending width 32
    assert wider[2] != sig[2] and wider[3] != sig[3]    # 32 -> 48 and 48 -> 32 differ


def test_range_key_follows_the_layers_it_holds():
    from torchalpa.passes.pipeline_search.layer_cache import range_signature
    sig = ["a", "b", "b", "b", "c"]
    assert range_signature(sig, 1, 2) == range_signature(sig, 2, 3)
    assert range_signature(sig, 1, 2) != range_signature(sig, 1, 3)
    assert range_signature(sig, 0, 1) != range_signature(sig, 1, 2)


def test_cache_solves_once_per_key_and_stays_bounded():
    from torchalpa.passes.pipeline_search.layer_cache import SolveCache
    cache = SolveCache(max_entries=2)
    calls = []
    solve = lambda: calls.append(1) or len(calls)     # noqa: E731
    assert cache.get("a", solve) == 1 and cache.get("a", solve) == 1
    assert (cache.hits, cache.misses) == (1, 1)
    cache.get("b", solve)
    cache.get("c", solve)                   # drops "a", the least recently used
    assert "a" not in cache and len(cache) == 2


@pytest.mark.parametrize("schedule", ["1f1b"])
def test_cached_search_plans_what_a_cold_search_plans(schedule):
    """The second search of the same step, given the first one's cache, reads every solve
    from it (none done) and returns the same stages, submeshes, views and estimates as the
    first; a search given no cache solves again."""
    import torchalpa
    from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
    from torchalpa.passes.pipeline_search.layer_cache import SolveCache
    graph = _graph([32, 32, 32, 32])
    method = torchalpa.PipeshardParallel(num_micro_batches=4, pipeline_schedule=schedule)
    cluster = torchalpa.Cluster.local_cpu(2)
    cache = SolveCache()
    cold = plan_pipeline(graph, cluster, method, solves=cache)
    assert cold.estimates["layer_solves"] > 0 and len(cache) > 0
    assert plan_pipeline(graph, cluster, method).estimates["layer_solves"] > 0
    warm = plan_pipeline(graph, cluster, method, solves=cache)
    assert warm.estimates["layer_solves"] == 0 and warm.estimates["stage_solves"] == 0
    assert warm.forward_stage_layer_ids == cold.forward_stage_layer_ids
    assert warm.submesh_shapes == cold.submesh_shapes
    assert warm.logical_shapes == cold.logical_shapes
    assert warm.estimates["step_time_s"] == pytest.approx(cold.estimates["step_time_s"])
    # identical middle layers were solved once per view, not once per layer
    views = 1 + 1       # (1,) on (1, 1); (2,) on (1, 2)
    assert cold.estimates["layer_solves"] <= 3 * views
