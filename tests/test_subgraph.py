"""Stage graphs: a pipeline stage's ops, what it receives and what it sends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_simplify import Residual

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.plan import OutputSlot
from torchalpa.frontends.torch_export import capture
from torchalpa.passes.pipeline_search.layers import cluster_layers
from torchalpa.passes.pipeline_search.subgraph import stage_subgraph
from torchalpa.passes.sharding.intra_op import plan_intra_op


@pytest.fixture(scope="module")
def split():
    with torch.device("meta"):
        model = Residual(32, 4)
        x, y = torch.empty(16, 32), torch.empty(16, 32)
    g = capture(model, (x, y), F.mse_loss).graph
    layer = cluster_layers(g, 4)
    stage_of = {n: l // 2 for n, l in layer.items()}
    return g, stage_of, [stage_subgraph(g, stage_of, s) for s in (0, 1)]


def test_stages_partition_the_step(split):
    g, stage_of, stages = split
    ops = [n.name for s in stages for n in s.graph.ops()]
    assert sorted(ops) == sorted(n.name for n in g.ops())
    for s in stages:
        s.graph.check()
    first, last = stages
    assert first.graph.outputs.loss is None and last.graph.outputs.loss is not None
    # every parameter's gradient is an output of the stage that owns the parameter
    owned = [set(s.graph.params) for s in stages]
    assert owned[0] | owned[1] == set(g.params) and not owned[0] & owned[1]
    for s, names in zip(stages, owned):
        assert set(dict(s.graph.outputs.grads)) == names


def test_what_one_stage_sends_the_other_receives(split):
    g, stage_of, (first, last) = split
    assert set(first.sends) == set(last.receives.values()) - _user_inputs(g)
    assert set(last.sends) == set(first.receives.values())
    # forward sends activations, backward sends gradients back
    assert {g.node(r.node).phase for r in first.sends} == {"forward"}
    assert {g.node(r.node).phase for r in last.sends} == {"backward"}


def _user_inputs(g):
    return set()


def test_each_stage_plans_on_its_own_mesh(split):
    g, stage_of, stages = split
    for s in stages:
        plan = plan_intra_op(s.graph, LogicalMesh(shape=(2,)))
        assert plan.estimates["step_time_s"] >= 0
        sends = [r for r in plan.reshards
                 if isinstance(r.slot, OutputSlot) and r.slot.kind == "send"]
        # sends leave the stage whole
        for r in sends:
            assert all(str(p) == "R" for p in r.steps[-1].dst)
