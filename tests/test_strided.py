"""Strided shards (``placement.strided``): a fused q/k/v projection split by heads.

Where the planner offers them (``passes/sharding/strides.py``), that a plan does not depend on how
q, k and v are spelled, and that the exporters which cannot express one say so. Training,
transitions and checkpoints: ``test_distributed.py::test_fused_qkv_projection_trains_split_by_heads``,
``test_reshard.py::test_strided_shard_transitions_give_dtensor_blocks``,
``test_runtime_dist.py::test_checkpoint_of_a_fused_qkv_split_by_heads``; every strided
strategy of every position-free op against the unsharded op: ``test_rules.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from alpa_cases import BertLayers, all_reduce_cost, assert_close, bert_inputs, plan_of, weights

import torchalpa.models as zoo
from torchalpa.core.placement import Replicate, Shard, strided
from torchalpa.frontends.torch_export import capture
from torchalpa.interop.hlo_annotate import hlo_sharding, sdy_sharding
from torchalpa.passes.sharding.strides import strided_regions


def _graph(model, inputs, loss_fn=F.mse_loss):
    with torch.device("meta"):
        model = model()
    return capture(model, tuple(t.to("meta") for t in inputs), loss_fn).graph


def test_the_region_runs_from_the_split_to_the_projection_and_its_gradients():
    graph = _graph(lambda: BertLayers(1, 32, 4, "fused_major"), bert_inputs(4, 8, 32))
    regions = strided_regions(graph)
    ops = {graph.node(n).op for n in regions}
    assert "aten.split_with_sizes.default" in ops and "aten.cat.default" in ops
    assert {graph.node(n).target for n in regions if graph.node(n).is_param} == {
        "layer.0.attention.qkv.weight", "layer.0.attention.qkv.bias"}
    assert all(cuts == ((3, 96),) for cuts in regions.values())
    # nothing beyond tensors with a (3H)-sized dim: the other projections are untouched
    assert not any("intermediate" in graph.node(n).module for n in regions)


def test_a_forward_only_capture_holds_the_projection_strided_too():
    """``predict`` plans the forward alone with the training layouts pinned; there the
    parameters are captured as state, not parameters, and the region must still reach
    them, or a weight trained as a strided shard cannot be pinned (torchvision's SwinV2 on
    a 2 x 2 mesh raised "cannot be pinned to _S(0, 3)R")."""
    from torchalpa.frontends.torch_export import capture_forward
    with torch.device("meta"):
        model = BertLayers(1, 32, 4, "fused_major")
    x, mask, _ = (t.to("meta") for t in bert_inputs(4, 8, 32))
    graph = capture_forward(model, [x, mask], None, outputs=True).graph
    assert not graph.params
    regions = strided_regions(graph)
    assert {graph.node(n).target for n in regions if graph.node(n).is_leaf} >= {
        "layer.0.attention.qkv.weight", "layer.0.attention.qkv.bias"}


@pytest.mark.parametrize("make,inputs", [
    (lambda: BertLayers(1, 32, 4, "separate"), bert_inputs(4, 8, 32)),
    (lambda: BertLayers(1, 32, 4, "fused_minor"), bert_inputs(4, 8, 32)),
])
def test_no_equal_cut_no_strided_strategies(make, inputs):
    assert strided_regions(_graph(make, inputs)) == {}


def test_a_view_as_pieces_heads_and_head_dim_starts_a_region():
    """timm's attention views its fused projection as (B, N, 3, H, D): the view's rule lets
    the heads factor split as a strided shard of 3H, so the projection's weight, bias and
    gradients may be held by heads (the zoo ViT, forward and backward views)."""
    vit = zoo.tiny("vit", dropout=0.0)
    torch.manual_seed(0)
    graph = capture(vit.build(), vit.example_inputs(), vit.loss_fn).graph
    regions = strided_regions(graph)
    assert {graph.node(n).target for n in regions if graph.node(n).is_param} == {
        f"blocks.{k}.attn.qkv.{w}" for k in range(2) for w in ("weight", "bias")}
    hidden = 3 * vit.build().blocks[0].attn.qkv.in_features
    assert {cuts for cuts in regions.values()} == {((3, hidden),)}


def test_rotary_half_swap_is_no_region():
    """LLaMA's rotary cats two equal halves, but no parameter is in reach of them."""
    llama = zoo.tiny("llama")
    torch.manual_seed(0)
    graph = capture(llama.build(), llama.example_inputs(), llama.loss_fn).graph
    assert any(n.op == "aten.cat.default" for n in graph.ops())
    assert strided_regions(graph) == {}


@pytest.mark.parametrize("qkv", ["fused_major", "fused_minor", "separate"])
def test_a_plan_does_not_depend_on_how_qkv_is_spelled(qkv):
    """Alpa's BERT model-parallel case (test_bert.py, B8 S8 H128 on (4, 1)): the same
    objective however q, k and v are written; the (3, H)-major fused weight as a strided
    shard, which is Megatron's layout for that spelling (1.57x the cost before)."""
    plan, mesh = plan_of(BertLayers(1, 128, 8, qkv), bert_inputs(8, 8, 128), shape=(4, 1),
                         all_reduce_threshold=1 << 60)
    # Alpa's count: 4 all-reduces of the (B, S, H) activations per layer, less one
    assert_close(plan.estimates.objective, 3 * all_reduce_cost(mesh, 8 * 8 * 128 * 4, 0))
    if qkv == "fused_major":
        assert weights(plan)["layer.0.attention.qkv.weight"][0] == strided(0, 3)


def test_exporters_that_cannot_express_a_strided_shard_say_what_to_do():
    with pytest.raises(ValueError, match="strided shard.*pin that parameter"):
        hlo_sharding((strided(0, 3),), 2, (4,))
    with pytest.raises(ValueError, match="strided shard.*pin that parameter"):
        sdy_sharding((Replicate(), strided(0, 3)), 2, ("a0", "a1"))
    assert hlo_sharding((Shard(0),), 2, (4,)) == "{devices=[4,1]<=[4]}"


def test_a_strided_plan_reads_back_shows_and_refuses_a_tp_plan(tmp_path):
    """The plan JSON keeps a strided shard (``StridedShard(0, 3)``), the summary shows it
    (``S(0)/3``), and ``to_tp_plan`` says no ParallelStyle holds one."""
    import torchalpa
    from torchalpa.interop.tp_plan import NotExpressibleError
    make = lambda: BertLayers(1, 128, 8, "fused_major")  # noqa: E731
    plan, _ = plan_of(make(), bert_inputs(8, 8, 128), shape=(4, 1))
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert "StridedShard(0, 3)" in path.read_text()
    again = torchalpa.Plan.load(str(path))
    assert [p.placements for p in again.parameters] == [p.placements for p in plan.parameters]
    assert any("qkv.weight" in line and "S(0)/3" in line for line in plan.summary().splitlines())
    with pytest.raises(NotExpressibleError, match="strided shard"):
        plan.to_tp_plan(make())


class FusedSwiGLU(torch.nn.Module):
    """A LLaMA MLP with gate and up fused into one projection, cut by ``chunk(2)``."""

    def __init__(self, hidden=64, inner=128):
        super().__init__()
        self.gate_up = torch.nn.Linear(hidden, 2 * inner, bias=False)
        self.down = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def test_a_fused_gate_up_projection_splits_as_megatron_does():
    """gate and up fused and chunked: each device its block of each (a strided shard with 2
    pieces), down split by rows: one all-reduce, of the output in forward (the input needs
    no gradient), as with two separate projections."""
    import torchalpa
    from torchalpa.core.cluster import LogicalMesh
    with torch.device("meta"):
        model = FusedSwiGLU()
    x = torch.empty(4, 16, 64, device="meta")
    plan = torchalpa.plan(model, (x, torch.empty_like(x)), F.mse_loss,
                          cluster=LogicalMesh(shape=(4,), alpha=(1e-3,), beta=(1e-7,)),
                          method=torchalpa.ShardParallel())
    placements = {p.name: p.placements for p in plan.parameters}
    assert placements == {"gate_up.weight": (strided(0, 2),), "down.weight": (Shard(1),)}
    assert [(c.kind, c.phase) for c in plan.collectives] == [("all_reduce", "forward")]


def _plan_holding(*placements):
    from types import SimpleNamespace
    return SimpleNamespace(parameters=[SimpleNamespace(name=f"p{i}", placements=p)
                                       for i, p in enumerate(placements)])


def test_parameters_split_by_heads_over_two_axes_are_named_and_warned_about():
    """DTensor's own ``full_tensor`` (PyTorch 2.13) gathers a stacked strided shard with
    its pieces mixed and no error (MPT's fused Wqkv on a 2 x 2 mesh), so the parameters
    held so are named once, with ``torchalpa.full_tensor`` as the way to read them."""
    from types import SimpleNamespace

    import torchalpa
    from torchalpa.runtime.execution.materialize import (
        StridedGatherWarning,
        _warn_stacked_strided,
        stacked_strided_names,
    )
    plan = _plan_holding((strided(0, 3), strided(0, 3)),      # stacked: named
                         (strided(0, 3), Replicate()),        # one axis: DTensor gathers it
                         (Shard(0), Shard(1)))
    assert stacked_strided_names(plan, (2, 2)) == ["p0"]
    assert stacked_strided_names(plan, (4, 1)) == []          # one axis of one device
    with pytest.warns(StridedGatherWarning, match=r"p0 .*torchalpa\.full_tensor\(p\)"):
        _warn_stacked_strided([(plan, SimpleNamespace(shape=(2, 2)))])
    whole = torch.ones(3)
    assert torchalpa.full_tensor(whole) is whole              # a plain tensor as it is
