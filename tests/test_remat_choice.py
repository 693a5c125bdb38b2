"""Choosing activation checkpointing: skipping a capture whose compute bound cannot win."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from torchalpa.core.plan_records import Estimates


@dataclass(frozen=True)
class _Plan:
    estimates: Estimates
    method: dict = field(default_factory=dict)
    notes: tuple = ()


@dataclass
class _Capture:
    step: float           # what planning it finds
    bound: float          # its compute lower bound
    fits: bool = True
    graph: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(meta={}))


def _choose(variants: dict, with_bound: bool):
    from torchalpa.passes.sharding.remat_choice import plan_with_remat
    solved = []

    def solve(c):
        solved.append(c)
        peak = 1.0 if c.fits else 3.0
        return _Plan(Estimates(step_time_s=c.step, memory_per_device_bytes=peak,
                               memory_budget_per_device_bytes=2.0))

    plan = plan_with_remat(variants, solve, lambda c: c.graph,
                           (lambda c: c.bound) if with_bound else None)
    return plan, solved


@pytest.mark.parametrize("full_step,full_bound,skipped", [
    (1.4, 1.3, True),      # its bound is above the plain plan: never planned
    (0.9, 0.8, False),     # might win: planned, and wins
    (1.4, 0.8, False),     # might win by its bound: planned, loses
    (1.0, 1.0, True),      # a tie: the first plan stays, as without the bound
])
def test_a_capture_is_planned_only_if_its_bound_could_win(full_step, full_bound, skipped):
    variants = {"none": _Capture(1.0, 0.75), "full": _Capture(full_step, full_bound)}
    plan, solved = _choose(variants, with_bound=True)
    unbounded, _ = _choose(variants, with_bound=False)
    assert plan.method["remat"] == unbounded.method["remat"]      # the same choice
    assert (variants["full"] not in solved) == skipped
    if skipped:
        assert "full: not planned, its compute alone takes" in plan.notes[-1]


def test_a_plan_over_its_budget_does_not_stop_the_next_capture():
    variants = {"none": _Capture(1.0, 0.75, fits=False), "full": _Capture(1.4, 1.3)}
    _, solved = _choose(variants, with_bound=True)
    assert variants["full"] in solved


def test_compute_lower_bound_is_below_the_planned_step():
    import torch

    import torchalpa
    import torchalpa.models as zoo
    from torchalpa.core.options import ShardParallel
    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.sharding.intra_op import plan_intra_op
    from torchalpa.passes.sharding.remat_choice import compute_lower_bound
    workload = zoo.tiny("gpt", batch_size=4)
    with torch.device("meta"):
        model, batch = workload.build(), workload.example_inputs()
    graph = capture(model, batch, workload.loss_fn).graph
    cluster = torchalpa.Cluster.h100(devices_per_node=4)
    bound = compute_lower_bound(graph, cluster)
    plan = plan_intra_op(graph, cluster.logical_mesh((4,)), ShardParallel(
        auto_sharding_option=torchalpa.AutoShardingOption(solver="highs")))
    assert 0 < bound <= plan.estimates.step_time_s
    assert compute_lower_bound(graph, cluster, 8) == pytest.approx(8 * bound)
