"""Readable plans: folded layers, communication by module, explain's suggestions."""

import pytest

from torchalpa.core.placement import Replicate, Shard
from torchalpa.core.plan import OUTPUT, Collective, OutputSlot, Plan, Reshard, ValuePlacement
from torchalpa.views.fold import fold, fold_indices, template

LAYER = {"input_layernorm.weight": (64,), "self_attn.q_proj.weight": (64, 64),
         "self_attn.o_proj.weight": (64, 64), "mlp.up_proj.weight": (256, 64),
         "mlp.down_proj.weight": (64, 256)}


def synthetic_plan(num_layers: int, odd_layer: int | None = None) -> Plan:
    """A plan shaped like a decoder's: the same parameters and collectives per layer."""
    params, collectives, reshards = [], [], []
    for i in range(num_layers):
        for j, (name, shape) in enumerate(LAYER.items()):
            full = f"layers.{i}.{name}"
            dim = 1 if (i == odd_layer and "up_proj" in name) else 0
            node = f"arg{i * 10 + j}_1"
            params.append(ValuePlacement(full, node, shape, (Replicate(), Shard(dim))))
            module = full.rsplit(".", 1)[0]
            grad = f"permute_{i * 10 + j}"
            collectives.append(Collective("all_reduce", 0, 4 * shape[0] * shape[-1], "backward",
                                          module, grad))
            reshards.append(Reshard(grad, 0, OUTPUT, OutputSlot.grad(full), ()))
        collectives.append(Collective("all_reduce", 1, 1 << 20, "forward",
                                      f"layers.{i}.mlp.down_proj", f"mm_{i}"))
    params.append(ValuePlacement("lm_head.weight", "arg_lm", (1000, 64), (Shard(0), Shard(1))))
    return Plan(mesh_shape=(2, 4), axis_names=("dp", "tp"), parameters=tuple(params),
                inputs=(ValuePlacement("input_ids", "arg_in", (8, 128), (Shard(0), Replicate())),),
                strategies=(), reshards=tuple(reshards), collectives=tuple(collectives),
                estimates={"step_time_s": 0.1, "memory_per_device_bytes": 1 << 30},
                method={"name": "ShardParallel"})


def test_fold_helpers():
    assert template("model.layers.12.mlp.w") == ("model.layers.{}.mlp.w", (12,))
    assert template("net.x12.w") == ("net.x12.w", ())
    assert fold_indices([5, 0, 1, 2, 3, 7]) == "0..3,5,7"
    rows = fold([("b.0.w", "R"), ("b.1.w", "R"), ("b.2.w", "S")])
    assert rows == [("b.{0..1}.w", "R", 2), ("b.2.w", "S", 1)]


def test_summary_fits_a_screen_whatever_the_depth():
    small, deep = synthetic_plan(4).summary(), synthetic_plan(32).summary()
    assert len(deep.splitlines()) == len(small.splitlines()) <= 50
    assert "layers.{0..31}.mlp.up_proj.weight" in deep and "x32" in deep
    assert "grad weight" in deep                   # gradients named, not permute_424
    assert "input_ids" in deep
    assert "permute" not in deep


def test_a_layer_planned_differently_keeps_its_row():
    text = synthetic_plan(8, odd_layer=5).summary()
    assert "layers.{0..4,6..7}.mlp.up_proj.weight" in text
    assert "layers.5.mlp.up_proj.weight" in text


def test_full_detail_and_filter():
    plan = synthetic_plan(4)
    full = plan.summary(detail="full")
    assert all(p.name in full for p in plan.parameters)
    one = plan.summary(filter="layers.2.*")
    assert "layers.2.mlp.up_proj.weight" in one and "layers.1." not in one
    assert "collectives per step: 6 " in one
    with pytest.raises(ValueError, match="detail must be one of"):
        plan.summary(detail="everything")


def test_explain_suggests_close_names():
    plan = synthetic_plan(4)
    assert "S(0)" in plan.explain("layers.1.mlp.up_proj.weight")
    with pytest.raises(KeyError) as info:
        plan.explain("layers.1.mlp.up_prj.weight")
    message = str(info.value)
    assert "did you mean 'layers.1.mlp.up_proj.weight'" in message
    assert not message.startswith('"')          # not KeyError's quoted repr


def test_an_auto_parallel_summary_shows_its_decision_as_one_table_of_families():
    """The summary: AutoParallel's choice and one row per candidate family (its best
    estimate, or why none of it was planned); ``explain_choice()`` and the full summary
    keep the line of every candidate tried, as the plan file does."""
    import dataclasses

    from torchalpa.core.choice_notes import describe_candidate
    tried = [f"  tried: {describe_candidate(k, r, m, g)}: not planned, an intra-op plan fits"
             for k in ("pipeline",) for r in ("none", "full") for m in (1, 2, 4, 8)
             for g in (False, True)]
    tried += ["  tried: intra-op, remat=full: est 0.25 s/step, 1.0 GiB per device (2.0 s)",
              "  tried: intra-op, remat=full, 2 micro-batches: est 0.2 s/step, 1.0 GiB per "
              "device (2.0 s)"]
    notes = ("planned for h100",
             "AutoParallel chose intra-op, remat=none: est 0.1 s/step",
             "runner-up: intra-op, remat=full, 2 micro-batches: est 0.2 s/step", *tried)
    plan = dataclasses.replace(synthetic_plan(2), notes=notes)
    text = plan.summary()
    assert not any("tried:" in line for line in text.splitlines())
    start = text.index("AutoParallel chose")
    table = text[start:].splitlines()[:-1]          # the last line says how to see more
    assert len(table) <= 12
    rows = {line.split("  ")[1].strip(): line for line in table[4:]}
    assert set(rows) == {"intra-op, remat=none", "intra-op, remat=full",
                         "pipeline, remat=none", "pipeline, remat=full"}
    assert "est 0.1 s/step (chosen)" in rows["intra-op, remat=none"]
    assert "est 0.2 s/step" in rows["intra-op, remat=full"]      # the family's best
    assert "an intra-op plan fits" in rows["pipeline, remat=full"]
    assert " 8 " in rows["pipeline, remat=none"]                  # tried, per family
    every = plan.explain_choice().splitlines()
    assert len(every) == 2 + len(tried) and every[2:] == list(tried)
    assert all(t in plan.summary(detail="full") for t in tried)
    assert plan.to_dict()["notes"] == list(notes)                  # the file is unchanged


def test_a_pipeline_summary_says_each_stages_states_and_the_device_peak():
    """Each stage's model states and its peak over the pipelined step (micro-batches in
    flight: the pipeline's ``stage_memory_bytes``, not one micro-batch's), and the device
    peak -- the fullest stage's -- against the budget."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import torchalpa
    from torchalpa.core.units import format_bytes
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])     # activations first
    batch = (torch.randn(512, 16), torch.randn(512, 16))
    plan = torchalpa.plan(model, batch, F.mse_loss, cluster=torchalpa.Cluster.local_cpu(2),
                          method=torchalpa.PipeshardParallel(
                              num_micro_batches=4, stage_option="uniform",
                              layer_option=torchalpa.AutoLayerOption(layer_num=2)))
    est, text = plan.estimates, plan.summary()
    assert len(plan.stages) == 2 and est.memory_per_device_bytes == max(est.stage_memory_bytes)
    assert f"memory per device {format_bytes(est.memory_per_device_bytes)} of " \
        f"{format_bytes(est.memory_budget_per_device_bytes)} (the fullest stage" in text
    first = plan.stages[0].plan.estimates.memory_per_device_bytes
    assert first < est.stage_memory_bytes[0]     # 1F1B: two micro-batches in flight there
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line[:1].isdigit()}
    for s in plan.stages:
        states = s.plan.estimates.model_state_bytes_per_device
        assert states > 0 and s.plan.estimates.memory_per_device_bytes <= \
            est.stage_memory_bytes[s.index]
        row = " ".join(rows[str(s.index)])
        assert f"{format_bytes(states)} {format_bytes(est.stage_memory_bytes[s.index])}" in row
