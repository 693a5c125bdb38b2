"""Activation checkpointing chosen per pipeline stage (passes/pipeline_search/stage_recompute.py): the pricing,
and the stage DP choosing it where a stage's kept activations do not fit. Numerics of a
recomputed stage run on 4 ranks in tests/test_pipeline.py (gpt_2x2_recompute)."""

from __future__ import annotations

import pytest
import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.plan import PipelinePlan
from torchalpa.frontends.torch_export import capture
from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
from torchalpa.passes.pipeline_search.stage_recompute import (
    received_bytes,
    recompute_memory,
    recompute_seconds,
)

P, L = torchalpa.PipeshardParallel, torchalpa.AutoLayerOption


@pytest.fixture(scope="module")
def gpt_graph():
    gpt = zoo.tiny("gpt", batch_size=2, dropout=0.0, num_layers=4)
    torch.manual_seed(0)
    return capture(gpt.build(), gpt.example_inputs(), gpt.loss_fn).graph


def _plan(graph, remat="none", budget=None, stage_option="auto"):
    option = torchalpa.AutoShardingOption(remat=remat, memory_budget_per_device=budget)
    return plan_pipeline(graph, torchalpa.Cluster.local_cpu(2), P(
        num_micro_batches=4, layer_option=L(layer_num=2), auto_sharding_option=option,
        stage_option=stage_option))


def test_pricing_adds_a_forward_and_keeps_only_inputs():
    assert recompute_seconds(3.0) == pytest.approx(4.0)
    # 3 micro-batches in flight: one at its peak, two holding their inputs
    assert recompute_memory(100.0, 50.0, 7.0, 3) == 100.0 + 50.0 + 2 * 7.0


def test_received_bytes_are_the_forward_values_sent_to_the_stage(gpt_graph):
    plan = _plan(gpt_graph, stage_option=torchalpa.ManualStageOption(
        forward_stage_layer_ids=[[0], [1]], submesh_shapes=[(1, 1), (1, 1)]))
    sent = sum(t.bytes for t in plan.transfers
               if t.dst_stage == 1 and t.phase == "forward" and not t.once_per_step)
    assert sent > 0
    assert received_bytes(gpt_graph, lambda n: plan.node_stage[n] == 1) == sent
    assert received_bytes(gpt_graph, lambda n: True) == 0    # one stage receives nothing


def test_tight_budget_makes_the_dp_recompute_a_stage(gpt_graph):
    """Kept, stage 0 (two micro-batches in flight under 1F1B) needs more than 90 % of its
    own peak: the DP recomputes it instead of falling back to one slow stage, fits the
    budget, and says so in the plan, its JSON and its summary."""
    kept = _plan(gpt_graph, stage_option=torchalpa.ManualStageOption(
        forward_stage_layer_ids=[[0], [1]], submesh_shapes=[(1, 1), (1, 1)]))
    budget = 0.9 * kept.estimates.stage_memory_bytes[0]
    assert kept.estimates.stage_memory_bytes[1] < budget
    plan = _plan(gpt_graph, remat="auto", budget=budget)
    assert [s.recompute for s in plan.stages] == [True, False]
    assert max(plan.estimates.stage_memory_bytes) <= budget
    # one more forward of stage 0 per micro-batch, nothing else
    assert plan.estimates.stage_step_s[0] == pytest.approx(
        recompute_seconds(plan.stages[0].plan.estimates.step_time_s))
    again = PipelinePlan.from_dict(plan.to_dict())
    assert [s.recompute for s in again.stages] == [True, False]
    assert "recompute" in plan.summary()
    # remat="none" never recomputes
    assert not any(s.recompute for s in _plan(gpt_graph, stage_option=torchalpa.ManualStageOption(
        forward_stage_layer_ids=[[0], [1]], submesh_shapes=[(1, 1), (1, 1)])).stages)


def test_replaying_draws_the_forwards_numbers_and_leaves_later_draws_unshifted():
    """A recompute replays the random state its forward began with (the same dropout
    masks), and the generator afterwards is where it was before the replay."""
    from torchalpa.runtime.execution.stage_replay import random_state, replaying
    rng = random_state(torch.device("cpu"))
    first = torch.rand(8)
    after = torch.get_rng_state()
    with replaying(rng, torch.device("cpu")):
        again = torch.rand(8)
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), after)
