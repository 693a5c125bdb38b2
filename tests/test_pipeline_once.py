"""A pipeline pays what a stage runs once per step (its gradients' final reduction, the
optimizer) once, after the stage's last backward, not once per micro-batch."""

from __future__ import annotations

import pytest
import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import AutoLayerOption, ManualStageOption, PipeshardParallel
from torchalpa.frontends.torch_export import capture
from torchalpa.passes.pipeline_search.inter_op import micro_batch_seconds, plan_pipeline


def _plan(graph, cluster, micro_batches: int):
    option = torchalpa.AutoShardingOption(force_batch_dim_to_mesh_dim=0)
    return plan_pipeline(graph, cluster, PipeshardParallel(
        num_micro_batches=micro_batches, layer_option=AutoLayerOption(layer_num=2),
        stage_option=ManualStageOption(forward_stage_layer_ids=[[0], [1]],
                                       submesh_shapes=[(1, 2), (1, 2)],
                                       logical_shapes=[(2,), (2,)], options=[option] * 2)))


def test_gradient_sync_and_optimizer_are_paid_once_per_pipeline_step():
    w = zoo.tiny("gpt", 4, num_layers=2, hidden=64, vocab_size=256)
    with torch.device("meta"):
        model, batch = w.build(), w.example_inputs()
    graph = capture(model, batch, w.loss_fn).graph
    cluster = torchalpa.Cluster.preset("h100", 1, 4)
    few, many = _plan(graph, cluster, 2), _plan(graph, cluster, 6)
    for plan in (few, many):
        once = [s.plan.estimates["once_per_step_s"] for s in plan.stages]
        assert all(o > 0 for o in once)      # data parallel: each stage all-reduces its grads
        # the schedule runs micro-batches without it; each stage pays it after its last one
        assert plan.estimates["stage_step_s"] == pytest.approx(
            [s.plan.estimates["step_time_s"] - o for s, o in zip(plan.stages, once)])
        ends = [max(e for *_, e in stage) + o
                for stage, o in zip(plan.estimates["timeline"], once)]
        assert plan.estimates["step_time_s"] >= max(ends) - 1e-12
    # four more micro-batches add four of the slowest stage's micro-batch, nothing else
    slowest = max(many.estimates["stage_step_s"])
    added = many.estimates["step_time_s"] - few.estimates["step_time_s"]
    assert added == pytest.approx(4 * slowest, rel=1e-6)
    with_once = max(s.plan.estimates["step_time_s"] for s in many.stages)
    assert added < 4 * with_once - 3 * min(s.plan.estimates["once_per_step_s"]
                                           for s in many.stages)


def test_a_stage_costs_the_search_its_share_of_the_once_per_step_work():
    e = {"step_time_s": 1.0, "once_per_step_s": 0.4}
    assert micro_batch_seconds(e, 4) == pytest.approx(0.6 + 0.1)
    assert micro_batch_seconds({"step_time_s": 1.0}, 4) == 1.0
