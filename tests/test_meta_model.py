"""``torchalpa.to_meta``: a CPU-built tied GPT moved to ``meta`` plans one table, the
CPU model's parameters exactly (``Module.to("meta")`` alone unties it)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import torchalpa
import torchalpa.models as zoo


def plan_names(model, workload, on_meta: bool):
    inputs = tuple(workload.example_inputs())
    if on_meta:
        inputs = tuple(x.to("meta") for x in inputs)
    mesh = torchalpa.LogicalMesh(shape=(2,), alpha=(1e-5,), beta=(1e-10,))
    plan = torchalpa.plan(model, inputs, workload.loss_fn, cluster=mesh,
                          method=torchalpa.ShardParallel(logical_mesh_shape=(2,)))
    return {p.name: "".join(map(str, p.placements)) for p in plan.parameters}


def test_a_tied_gpt_moved_to_meta_keeps_one_table_and_plans_it_once():
    workload = zoo.tiny("gpt")
    torch.manual_seed(0)
    cpu = workload.build()
    assert cpu.lm_head.weight is cpu.wte.weight
    untied = copy.deepcopy(cpu).to("meta")            # torch's own move: two tables
    assert untied.lm_head.weight is not untied.wte.weight
    moved = torchalpa.to_meta(copy.deepcopy(cpu))
    assert moved.lm_head.weight is moved.wte.weight and moved.wte.weight.is_meta
    assert len(list(moved.parameters())) == len(list(cpu.parameters()))
    planned = plan_names(moved, workload, on_meta=True)
    assert sorted(planned) == sorted(name for name, _ in cpu.named_parameters())
    assert "wte.weight" in planned and "lm_head.weight" not in planned


def test_shared_buffers_stay_shared_and_distinct_ones_distinct():
    class Pair(nn.Module):
        def __init__(self, table=None):
            super().__init__()
            self.register_buffer("table", torch.ones(3) if table is None else table)
            self.own = nn.Linear(3, 3)

    first = Pair()
    root = nn.ModuleDict({"a": first, "b": Pair(first.table), "c": Pair()})
    torchalpa.to_meta(root)
    assert root["a"].table is root["b"].table and root["a"].table.is_meta
    assert root["c"].table is not root["a"].table
    assert root["a"].own.weight is not root["b"].own.weight
