"""Where the pricing places each gradient bucket's packing (passes/pricing/grad_buckets.py):
hand-made gradients against DDP's caps, and a planned MLP's buckets against the ones the
runtime forms from its plan (runtime/rewrites/buckets.py, ``gradient_buckets``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
import torchalpa.passes.sharding.intra_op as intra_op
from torchalpa.passes.pricing.grad_buckets import packing_points
from torchalpa.runtime.rewrites.buckets import gradient_buckets

MIB = 2 ** 20


def test_buckets_fill_in_backward_order_under_ddps_caps():
    """Gradients made at points 10, 20, ... (parameters' order; backward makes the last
    first): the last one alone fills the 1 MiB first bucket, then 25 MiB buckets; each
    gradient's bucket is packed where its last-made member is made."""
    made = [(60, 4 * MIB, 4), (50, 4 * MIB, 4), (40, 10 * MIB, 4), (30, 10 * MIB, 4),
            (20, 4 * MIB, 4), (10, MIB, 4)]
    # backward: 10 (1 MiB, first bucket full) | 20, 30, 40 (24 MiB) | 50, 60
    assert packing_points(made) == [60, 60, 40, 40, 40, 10]


def test_buckets_keep_element_sizes_apart_and_a_zero_cap_packs_nothing():
    made = [(30, 8, 2), (20, 8, 4), (10, 8, 2)]
    assert packing_points(made, bucket_bytes=100) == [30, 20, 30]
    assert packing_points(made, bucket_bytes=0) == [30, 20, 10]
    # a cap set by the plan caps the first bucket too
    assert packing_points(made, bucket_bytes=8) == [30, 20, 10]


def _narrow_mlp(width: int, num_layers: int):
    with torch.device("meta"):
        layers: list[nn.Module] = []
        for i in range(num_layers):
            layers += [nn.Linear(width, 4 * width) if i % 2 == 0 else
                       nn.Linear(4 * width, width), nn.ReLU()]
        return nn.Sequential(*layers), (torch.empty(2, width), torch.empty(2, width))


def _solved(monkeypatch, width: int, method):
    """``method``'s plan of the 8-layer ``_narrow_mlp`` on 2 CPU ranks, solved (not read
    from the cache), and the (graph, memory model, chosen strategies) of its last ILP
    solve."""
    seen = []
    solve = intra_op._solve_within_memory

    def recording(graph, S, grouping, cg, memory, *args, **kwargs):
        solution, chosen = solve(graph, S, grouping, cg, memory, *args, **kwargs)
        seen.append((graph, memory, chosen))
        return solution, chosen

    monkeypatch.setattr(intra_op, "_solve_within_memory", recording)
    monkeypatch.setenv("TORCHALPA_CACHE", "0")
    try:
        plan = torchalpa.plan(*_narrow_mlp(width, 8), F.mse_loss, method=method,
                              cluster=torchalpa.Cluster.local_cpu(2))
    finally:
        monkeypatch.undo()
    return plan, seen[-1]


@pytest.mark.parametrize("width", [256, 512])
def test_the_priced_buckets_are_the_runtimes(monkeypatch, width):
    """ZeRO-2 on 2 ranks, 8 layers: the gradients whose reduction copies are counted at
    one point are exactly the members of one of the runtime's buckets (width 512: a
    bucket of 12 gradients, one of 3 and the last bias alone; 256: 15 and one), and those
    copies add up, for the solved plan, to the bucket's bytes there."""
    plan, (graph, memory, chosen) = _solved(monkeypatch, width, torchalpa.Zero2Parallel())
    runtime = {frozenset(b.params): b.bytes for b in gradient_buckets(plan)}
    assert len(runtime) >= 1 and max(len(m) for m in runtime) >= 3
    live = memory.live
    at: dict[int, set[str]] = {}
    for transient, (_, reduced) in live.transient_of.items():
        at.setdefault(int(live.start[transient]), set()).add(graph.node(live.names[reduced]).target)
    priced = {frozenset(members) for members in at.values()}
    assert set(runtime) <= priced
    alone = priced - set(runtime)
    assert all(len(m) == 1 for m in alone)      # the runtime reduces these on their own
    for point, members in at.items():
        if frozenset(members) in runtime:
            sizes = [memory._act[t][memory.S[live.names[t]].index(chosen[live.names[t]])]
                     for t in live.transient_of if live.start[t] == point]
            assert sum(sizes) == pytest.approx(runtime[frozenset(members)])


def test_data_parallel_buckets_are_held_from_the_steps_start_as_kept_buffers(monkeypatch):
    """``DataParallel`` on 2 ranks, 8 layers of width 512: the runtime packs its buckets of
    two or more gradients into flat buffers it keeps from step to step
    (``runtime/rewrites/kept_buckets.py``). The estimate holds those gradients from the
    step's start (``Liveness.kept_of``): at point 0, the bytes of every all-reduce bucket
    the runtime forms; under ZeRO-2 (reduce-scatter, fresh buffers) none."""
    from torchalpa.passes.pricing.memory import _entry_bytes
    for method, expect_kept in ((torchalpa.DataParallel, True), (torchalpa.Zero2Parallel, False)):
        plan, (graph, memory, chosen) = _solved(monkeypatch, 512, method())
        live = memory.live
        sizes = _entry_bytes(graph, live, {k: s.outputs for k, s in chosen.items()},
                             memory.mesh_shape, memory.statistics)
        heads = [head for _, head in live.kept_of.values()]
        at_start = sum(sizes[h] for h in heads if live.start[h] <= 0 <= live.end[h])
        kept = sum(b.bytes for b in gradient_buckets(plan) if b.kind == "all_reduce")
        assert at_start == (kept if expect_kept else 0) and (kept > 0) == expect_kept
