"""Sequence-parallel norms under tensor parallelism, planned (no ranks): a zoo GPT on a
1-D tensor-parallel mesh with Megatron's column / row styles pinned.

``sequence_parallel=True`` splits every layer norm by sequence and the memory estimate
drops below plain TP's; without it, a budget plain TP does not fit makes the ILP split
norms by sequence by itself. With ``sequence_parallel=True`` no forward view that backward
reads holds a gathered copy (Megatron's gathers again in backward); without that rule the
ILP may keep one, and its memory is priced: a budget makes it gather again."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import torchalpa
from torchalpa.core.placement import Shard
from torchalpa.frontends.torch_export import capture
from torchalpa.models import gpt
from torchalpa.passes.pricing.gathered_views import saved_view_spans
from torchalpa.passes.sharding.costgraph import saved_views
from torchalpa.passes.sharding.reshard import local_bytes

TP = 4
STYLES = {"h.*.attn.c_attn": ColwiseParallel(), "h.*.attn.c_proj": RowwiseParallel(),
          "h.*.mlp.c_fc": ColwiseParallel(), "h.*.mlp.c_proj": RowwiseParallel()}
CONFIG = gpt.GPTConfig(vocab_size=128, max_seq_len=256, num_layers=4, num_heads=4,
                       hidden=128, dropout=0.0)


def model_and_batch():
    torch.manual_seed(0)
    return gpt.GPT(CONFIG), gpt.example_batch(CONFIG, 2, seq_len=256)


def plan_for(**option):
    model, batch = model_and_batch()
    option.setdefault("pin", STYLES)
    opt = torchalpa.AutoShardingOption(**option)
    return torchalpa.plan(model, batch, gpt.loss_fn, cluster=torchalpa.Cluster.h100(
        devices_per_node=TP), method=torchalpa.ShardParallel(logical_mesh_shape=(TP,),
                                                             auto_sharding_option=opt))


def norm_layouts(plan) -> list:
    return [s.outputs[0] for s in plan.strategies if s.node.startswith("native_layer_norm")
            and "backward" not in s.node]


@pytest.fixture(scope="module")
def plans():
    return {"tp": plan_for(), "sp": plan_for(sequence_parallel=True)}


def test_sequence_parallel_splits_norms_and_lowers_the_memory_estimate(plans):
    tp, sp = plans["tp"], plans["sp"]
    assert all(p == (Shard(1),) for p in norm_layouts(sp)), norm_layouts(sp)
    assert not any(p == (Shard(1),) for p in norm_layouts(tp)), norm_layouts(tp)
    kinds = {c.kind for c in sp.collectives}
    assert {"all_gather", "reduce_scatter"} <= kinds, kinds
    assert sp.estimates.memory_per_device_bytes < 0.9 * tp.estimates.memory_per_device_bytes
    assert sp.estimates.saved_activation_bytes_per_device < \
        tp.estimates.saved_activation_bytes_per_device


def test_a_tight_budget_makes_the_ilp_split_norms_by_sequence(plans):
    tp, sp = plans["tp"], plans["sp"]
    budget = sp.estimates.memory_per_device_bytes
    assert tp.estimates.memory_per_device_bytes > budget      # plain TP does not fit
    tight = plan_for(memory_budget_per_device=budget)
    assert tight.estimates.memory_per_device_bytes <= budget
    split = [p for p in norm_layouts(tight) if p == (Shard(1),)]
    assert len(split) >= 4, norm_layouts(tight)     # of 9; the ILP may keep others whole
    assert tight.estimates.step_time_s <= sp.estimates.step_time_s * (1 + 1e-9)


def test_no_saved_view_holds_a_gathered_copy(plans):
    model, batch = model_and_batch()
    graph = capture(model, batch, gpt.loss_fn).graph
    saved = saved_views(graph)
    assert saved
    plan = plans["sp"]
    by_read = {(r.consumer, r.slot): r for r in plan.reshards}

    def grows(r) -> bool:
        spec = graph.node(r.producer).outputs[r.index]
        src = plan.strategy(r.producer).outputs[r.index]
        return local_bytes(spec, plan.strategy(r.consumer).inputs[r.slot], (TP,)) > \
            local_bytes(spec, src, (TP,))
    gathered = [r for r in plan.reshards if isinstance(r.slot, int)
                and graph.node(r.producer).kind == "op" and grows(r)]
    assert gathered        # the norms' outputs, gathered for the column-parallel products
    assert not [r for r in gathered if r.consumer in saved]
    for r in gathered:     # a gathered copy is not shared from forward to backward
        if r.same_as is not None:
            assert graph.node(r.consumer).phase == graph.node(by_read[r.same_as].consumer).phase


def gathered_saved_views(plan) -> int:
    """Operand reads of forward views backward reads, in a larger layout than made."""
    model, batch = model_and_batch()
    graph = capture(model, batch, gpt.loss_fn).graph
    views = {s.view for s in saved_view_spans(graph)}

    def nbytes(r, layout) -> int:
        return local_bytes(graph.node(r.producer).outputs[r.index], layout, (TP,))
    return sum(1 for r in plan.reshards if r.consumer in views and r.slot == 0 and
               nbytes(r, plan.strategy(r.consumer).inputs[0]) >
               nbytes(r, plan.strategy(r.producer).outputs[r.index]))


def test_a_kept_gathered_copy_is_priced_and_a_budget_makes_the_ilp_gather_again(
        plans, monkeypatch):
    from torchalpa.passes.sharding import intra_op
    from torchalpa.passes.sharding.costgraph import REGATHER_SAVED_VIEWS
    rule = intra_op.forbidden_collectives
    monkeypatch.setattr(intra_op, "forbidden_collectives",
                        lambda option: rule(option) - {REGATHER_SAVED_VIEWS})
    monkeypatch.setenv("TORCHALPA_CACHE", "0")    # the cache's key does not see the patch
    sp = plans["sp"]
    assert gathered_saved_views(sp) == 0
    kept = plan_for(sequence_parallel=True)
    assert gathered_saved_views(kept) > 0
    # the copies are in the estimate: more memory than gathering again, for less time
    assert kept.estimates.memory_per_device_bytes > sp.estimates.memory_per_device_bytes
    assert kept.estimates.step_time_s <= sp.estimates.step_time_s * (1 + 1e-9)
    budget = sp.estimates.memory_per_device_bytes
    tight = plan_for(sequence_parallel=True, memory_budget_per_device=budget)
    assert tight.estimates.memory_per_device_bytes <= budget
    assert gathered_saved_views(tight) < gathered_saved_views(kept)


def test_sequence_parallel_names_a_sequence_that_does_not_divide():
    torch.manual_seed(0)
    config = gpt.GPTConfig.tiny(num_heads=4, dropout=0.0)
    opt = torchalpa.AutoShardingOption(pin=STYLES, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel=True: .* sequence length"):
        torchalpa.plan(gpt.GPT(config), gpt.example_batch(config, 2, seq_len=6), gpt.loss_fn,
                       cluster=torchalpa.Cluster.h100(devices_per_node=TP),
                       method=torchalpa.ShardParallel(logical_mesh_shape=(TP,),
                                                      auto_sharding_option=opt))


def test_a_reduce_scatter_and_an_all_gather_cost_an_all_reduce_and_one_more_latency():
    from torchalpa.core.collective_math import alpha_beta_seconds, wire_bytes
    n, whole, a, b = 4, 1 << 20, 1e-5, 1e-10
    ar = alpha_beta_seconds("all_reduce", n, whole, a, b)
    rs_ag = alpha_beta_seconds("reduce_scatter", n, whole, a, b) + \
        alpha_beta_seconds("all_gather", n, whole / n, a, b)
    assert rs_ag == pytest.approx(ar + a)
    assert wire_bytes("reduce_scatter", n, whole) + wire_bytes("all_gather", n, whole / n) == \
        pytest.approx(wire_bytes("all_reduce", n, whole))
    # on gloo a reduce-scatter is an all-reduce underneath, and priced as one
    assert alpha_beta_seconds("reduce_scatter", n, whole, a, b, "gloo") == pytest.approx(ar)


def test_plain_tensor_parallel_keeps_every_norm_whole_as_megatron_ran_it(plans):
    # Megatron-LM before sequence parallelism: norms whole on every tp rank. Where only
    # norms split by sequence fit, the ILP splits them by itself; pinned plain it cannot,
    # and says the step does not fit rather than plan what the run did not do
    from torchalpa.core.placement import Replicate
    from torchalpa.passes.sharding.ilp import InfeasibleError
    budget = plans["sp"].estimates.memory_per_device_bytes
    free = plan_for(memory_budget_per_device=budget)
    assert any(p == (Shard(1),) for p in norm_layouts(free))
    with pytest.raises(InfeasibleError, match="does not fit"):
        plan_for(memory_budget_per_device=budget, plain_tensor_parallel=True)
    plain = plan_for(plain_tensor_parallel=True)
    assert norm_layouts(plain) and all(p == (Replicate(),) for p in norm_layouts(plain))
    assert "all_reduce" in {c.kind for c in plain.collectives}
    with pytest.raises(ValueError, match="set one of them"):
        torchalpa.AutoShardingOption(sequence_parallel=True, plain_tensor_parallel=True)
