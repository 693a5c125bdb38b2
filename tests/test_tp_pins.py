"""``pin=`` with torch's tensor-parallel styles (``torchalpa/parallel/tp_pins.py``): each style pins
the parameters it lays out, on the last mesh axis, as the equivalent placements would."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

import torchalpa
from torchalpa.parallel.tp_pins import style_pins


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.wq = nn.Linear(16, 32)
        self.wo = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.wo(F.relu(self.wq(self.norm(x))))


class Stack(nn.Module):
    """An embedding and two blocks (``layers.{0,1}.{norm,wq,wo}``)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return h


def plan_for(pin, shape=(2, 2)):
    torch.manual_seed(0)
    ids, target = torch.randint(32, (8, 4)), torch.randn(8, 4, 16)
    method = torchalpa.ShardParallel(
        logical_mesh_shape=shape, auto_sharding_option=torchalpa.AutoShardingOption(pin=pin))
    mesh = torchalpa.LogicalMesh(shape=shape, alpha=(1.0,) * len(shape),
                                 beta=(1.0,) * len(shape))
    return torchalpa.plan(Stack(), (ids, target), F.mse_loss, method=method, cluster=mesh)


def layouts(plan) -> dict[str, str]:
    return {p.name: "".join(str(q) for q in p.placements) for p in plan.parameters}


def test_styles_plan_exactly_as_the_equivalent_placements():
    styles = {"embed": RowwiseParallel(), "layers.*.wq": ColwiseParallel(),
              "layers.*.wo": RowwiseParallel(), "layers.*.norm": SequenceParallel()}
    placements = {r"embed[.]weight": ("*", Shard(0)),
                  r"layers[.]\d+[.]wq[.](weight|bias)": ("*", "S(0)"),
                  r"layers[.]\d+[.]wo[.]weight": ("*", "S(1)"),
                  r"layers[.]\d+[.]wo[.]bias": ("*", Replicate()),
                  r"layers[.]\d+[.]norm[.].*": ("*", "R")}
    by_style, by_placements = plan_for(styles), plan_for(placements)
    assert layouts(by_style) == layouts(by_placements)
    assert [c.to_dict() for c in by_style.collectives] == \
        [c.to_dict() for c in by_placements.collectives]
    assert by_style.estimates.step_time_s == by_placements.estimates.step_time_s
    got = layouts(by_style)     # and the layouts are the styles' on the last (tp) axis
    for i in (0, 1):
        assert got[f"layers.{i}.wq.weight"].endswith("S(0)")
        assert got[f"layers.{i}.wo.weight"].endswith("S(1)")
        assert got[f"layers.{i}.wo.bias"].endswith("R")
    assert got["embed.weight"].endswith("S(0)")


def test_a_style_pins_the_last_axis_of_any_mesh():
    plan = plan_for({"layers.*.wq": ColwiseParallel()}, shape=(4,))
    assert layouts(plan)["layers.1.wq.weight"] == "S(0)"


def test_translation_is_per_module_type_and_exact_names():
    pins = style_pins((("embed", ColwiseParallel()), ("layers.0.wq", ColwiseParallel()),
                       ("x", ("R",))), Stack())
    assert pins == ((r"embed\.weight", ("...", "S(1)")),
                    (r"layers\.0\.wq\.weight", ("...", "S(0)")),
                    (r"layers\.0\.wq\.bias", ("...", "S(0)")), ("x", ("R",)))


def test_styles_without_meaning_here_are_named():
    with pytest.raises(ValueError, match=r"SequenceParallel on 'layers.0.wq' \(Linear\) has no "
                                         r"meaning here.*norm"):
        style_pins((("layers.*.wq", SequenceParallel()),), Stack())
    with pytest.raises(ValueError, match=r"ColwiseParallel on 'layers.0.norm' \(LayerNorm\)"):
        style_pins((("layers.*.norm", ColwiseParallel()),), Stack())
    with pytest.raises(ValueError, match="PrepareModuleInput on 'layers.0' only changes"):
        style_pins((("layers.0", PrepareModuleInput(input_layouts=(Replicate(),),
                                                   desired_input_layouts=(Shard(1),))),),
                   Stack())
    with pytest.raises(ValueError, match=r"matches no module.*close: layers.0.wq"):
        style_pins((("layers.0.wk", ColwiseParallel()),), Stack())


def test_activation_layouts_of_a_style_are_announced_as_not_followed():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        style_pins((("layers.*.wo", RowwiseParallel(output_layouts=Shard(1))),), Stack())
    assert any("only its parameter layouts are pinned" in str(w.message) for w in caught)


def test_dots_only_lead():
    with pytest.raises(ValueError, match="'...' may only come first"):
        torchalpa.AutoShardingOption(pin={"w": ("S(0)", "...")})
