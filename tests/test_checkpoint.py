"""Activation checkpointing (frontends/block_remat.py, passes/sharding/remat_choice.py): the rewritten
step computes what the plain step computes, recomputes each block's forward in backward,
the planner sees less memory and more flops, 'auto' chooses by the plan, and training with
it on real gloo ranks (tests/remat_worker.py) equals training on one device."""

from __future__ import annotations

import json

import pytest
import torch
import worker_io

import torchalpa
import torchalpa.models as zoo
from torchalpa.frontends.block_remat import checkpointed_capture
from torchalpa.frontends.torch_export import capture
from torchalpa.passes.pricing.memory import activation_peak_bytes
from torchalpa.passes.sharding.ilp import InfeasibleError


@pytest.fixture(scope="module")
def gpt():
    return zoo.tiny("gpt", batch_size=8, dropout=0.0, num_layers=3)


@pytest.fixture(scope="module")
def captures(gpt):
    torch.manual_seed(0)
    model = gpt.build()
    batch = gpt.example_inputs()
    plain = capture(model, batch, gpt.loss_fn)
    return model, batch, {"none": plain, "full": checkpointed_capture(plain),
                          "selective": checkpointed_capture(plain, "selective")}


def _replicated_outputs(graph):
    from torchalpa.core.placement import Replicate
    return {n.name: tuple((Replicate(),) for _ in n.outputs) for n in graph}


def test_checkpointed_step_computes_the_same_loss_and_gradients(captures):
    model, batch, c = captures
    params = [p for _, p in model.named_parameters()]
    buffers = [b for _, b in model.named_buffers()]
    plain = c["none"].gm(params, buffers, *batch)
    for mode in ("full", "selective"):
        checkpointed = c[mode].gm(params, buffers, *batch)
        assert len(plain) == len(checkpointed)
        for a, b in zip(plain, checkpointed):
            if a is not None:
                torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_each_block_recomputes_its_matmuls_in_backward(captures):
    _, _, c = captures
    info = c["full"].graph.meta["remat"]
    assert info["blocks"] == 3          # the tiny GPT's three transformer blocks

    def matmuls(graph, phase):
        return sum(1 for n in graph.ops() if n.phase == phase and n.op == "aten.mm.default")

    plain, full = c["none"].graph, c["full"].graph
    in_blocks = sum(1 for n in plain.ops() if n.phase == "forward"
                    and n.op == "aten.mm.default" and n.module.startswith("h."))
    assert in_blocks == 3 * 4           # qkv, attention out, fc, proj per block
    assert matmuls(full, "forward") == matmuls(plain, "forward")
    # qkv, attention out and fc run again; the last projection's result only feeds the
    # residual add, whose backward does not read it, so it is not recomputed
    assert matmuls(full, "backward") == matmuls(plain, "backward") + 3 * 3
    forward_flops = sum(n.flops for n in plain.ops() if n.phase == "forward"
                        and n.module.startswith("h."))
    added = sum(n.flops for n in full.ops()) - sum(n.flops for n in plain.ops())
    assert 0.5 * forward_flops < added < forward_flops


def test_selective_checkpointing_recomputes_no_matmul_and_saves_between(captures):
    """Selective keeps matrix products' and attention's results: backward recomputes only
    cheap ops, and forward keeps more than full checkpointing but less than none."""
    _, _, c = captures
    plain, selective = c["none"].graph, c["selective"].graph
    assert selective.meta["remat"]["mode"] == "selective"
    assert selective.meta["remat"]["blocks"] == 3 and selective.meta["remat"]["recomputed_ops"] > 0

    def count(graph, op):
        return sum(1 for n in graph.ops() if n.op == op)

    assert count(selective, "aten.mm.default") == count(plain, "aten.mm.default")
    added = sum(n.flops for n in selective.ops()) - sum(n.flops for n in plain.ops())
    forward_flops = sum(n.flops for n in plain.ops() if n.phase == "forward"
                        and n.module.startswith("h."))
    assert 0 < added < 0.1 * forward_flops
    peak = {m: activation_peak_bytes(g.graph, _replicated_outputs(g.graph), (1,))[1]
            for m, g in c.items()}
    assert peak["full"] < peak["selective"] < peak["none"]


def test_forward_saves_far_less_for_backward(captures):
    _, _, c = captures
    peak = {m: activation_peak_bytes(g.graph, _replicated_outputs(g.graph), (1,))
            for m, g in c.items()}
    # what waits for backward (saved) shrinks to the block inputs and the head's values
    assert peak["full"][1] < 0.35 * peak["none"][1]
    assert peak["full"][0] < peak["none"][0]


def test_planner_estimates_less_activation_memory_and_more_time(gpt):
    torch.manual_seed(0)
    plans = {m: torchalpa.plan(gpt.build(), gpt.example_inputs(), gpt.loss_fn,
                               method=torchalpa.ShardParallel(
                                   auto_sharding_option=torchalpa.AutoShardingOption(remat=m)),
                               cluster=torchalpa.Cluster.local_cpu(1))
             for m in ("none", "full")}
    est = {m: p.estimates for m, p in plans.items()}
    assert est["full"].saved_activation_bytes_per_device < \
        0.35 * est["none"].saved_activation_bytes_per_device
    assert est["full"].activation_bytes_per_device < est["none"].activation_bytes_per_device
    assert est["full"].step_time_s > est["none"].step_time_s
    assert plans["full"].method["remat"] == "full" and plans["none"].method["remat"] == "none"
    text = plans["full"].summary()
    assert "activation checkpointing: full (3 blocks" in text
    assert json.loads(plans["full"].to_json())["method"]["remat"] == "full"


def test_auto_keeps_activations_when_they_fit_and_checkpoints_when_they_do_not(gpt):
    def plan(budget):
        option = torchalpa.AutoShardingOption(remat="auto", memory_budget_per_device=budget)
        return torchalpa.plan(gpt.build(), gpt.example_inputs(), gpt.loss_fn,
                              method=torchalpa.ShardParallel(auto_sharding_option=option),
                              cluster=torchalpa.Cluster.local_cpu(1))
    roomy = plan(None)
    assert roomy.method["remat"] == "none"       # recomputation only costs time here
    assert any("remat='auto' chose 'none'" in n for n in roomy.notes)
    need = {m: plan_for(gpt, m).estimates.memory_per_device_bytes for m in ("none", "full")}
    tight = plan((need["none"] + need["full"]) / 2)  # only the checkpointed step fits
    assert tight.method["remat"] == "full"
    assert any("none: does not fit" in n for n in tight.notes)
    with pytest.raises(InfeasibleError, match="with or without activation checkpointing"):
        plan(need["full"] * 0.5)


def plan_for(gpt, remat):
    option = torchalpa.AutoShardingOption(remat=remat)
    return torchalpa.plan(gpt.build(), gpt.example_inputs(), gpt.loss_fn,
                          method=torchalpa.ShardParallel(auto_sharding_option=option),
                          cluster=torchalpa.Cluster.local_cpu(1))


def test_a_bad_remat_setting_names_the_choices():
    with pytest.raises(ValueError, match=r"remat must be one of \(.none., .selective., .full., .auto.\)"):
        torchalpa.AutoShardingOption(remat="yes")


def launch(nproc: int, tmp_path) -> dict:
    """remat_worker.py on the session's ``nproc``-rank pool (tests/worker_io.py): real gloo
    ranks, without paying a fresh torchrun's imports and rendezvous per test."""
    return worker_io.launch_checked("remat_worker.py", tmp_path / f"remat_{nproc}.json",
                                    nproc=nproc, timeout=900)


def _trains_like_one_device(r):
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert got == pytest.approx(want, rel=1e-5)
    assert r["max_param_diff"] < 1e-4


def test_checkpointed_intra_op_training_equals_one_device_on_two_ranks(tmp_path):
    r = launch(2, tmp_path)
    assert r["intra_full"]["remat"] == "full" and r["intra_none"]["remat"] == "none"
    _trains_like_one_device(r["intra_full"])
    # and equals plain (uncheckpointed) parallel training step by step
    assert r["intra_full"]["losses"] == pytest.approx(r["intra_none"]["losses"], rel=1e-6)


def test_checkpointed_pipeline_training_equals_one_device_on_four_ranks(tmp_path):
    r = launch(4, tmp_path)["pipeline_full"]
    assert r["remat"] == "full"
    assert r["sent_bytes"] == r["planned_bytes"]
    _trains_like_one_device(r)


def test_a_dropout_is_recomputed_from_the_mask_forward_drew():
    # Megatron's full recompute holds no dropout result: the recompute makes each again
    # from its input and forward's mask (one byte an element kept, not the 16-bit result
    # too), computing the same numbers as the plain step
    gpt = zoo.tiny("gpt", batch_size=4, dropout=0.1, num_layers=2)
    torch.manual_seed(0)
    model, batch = gpt.build(), gpt.example_inputs()
    plain = capture(model, batch, gpt.loss_fn)
    full = checkpointed_capture(plain)
    params = [p for _, p in model.named_parameters()]
    buffers = [b for _, b in model.named_buffers()]
    torch.manual_seed(1)
    want = plain.gm(params, buffers, *batch)
    torch.manual_seed(1)
    got = full.gm(params, buffers, *batch)
    for a, b in zip(want, got):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    graph = full.graph
    drops = [n for n in graph if n.op == "aten.native_dropout.default"]
    backward_reads = {ref.node: ref.index for n in graph if n.phase == "backward"
                      for ref in n.operands}
    assert drops and all(d.name not in backward_reads or backward_reads[d.name] == 1
                         for d in drops if d.module.startswith("h."))
    # the recompute multiplies the recomputed input by the mask of each dropout whose
    # result backward reads (attention probabilities and attention output, per block;
    # the MLP's feeds only the block's output, which is kept)
    masks = {d.name for d in drops if d.module.startswith("h.")}
    remade = [n for n in graph if n.phase == "backward" and n.op == "aten.mul.Tensor"
              and any(ref.node in masks and ref.index == 1 for ref in n.operands)]
    assert len(remade) == 2 * 2


@pytest.mark.parametrize("mode,regather,hold", [("full", False, False), ("full:1", True, False),
                                                ("selective", False, False),
                                                ("none", True, False), ("full", False, True)])
def test_a_variant_reuses_only_ops_the_rewrite_left_as_they_were(captures, mode, regather, hold):
    """``checkpointed_capture`` describes again only the ops its rewrite changed
    (``to_opgraph(known=unchanged_ops(...))``): its OpGraph is the one made from scratch,
    node for node, and most ops are reused."""
    from torchalpa.frontends.torch_export import to_opgraph, unchanged_ops
    _, _, c = captures
    plain = c["none"]
    variant = checkpointed_capture(plain, mode, rematerialize_parameters=regather,
                                   keep_parameter_values=hold)
    kinds = ([("param", k) for k in plain.param_names]
             + [("buffer", k) for k in plain.buffer_names]
             + [("input", k) for k in plain.input_names])
    fresh = to_opgraph(variant.gm, kinds, plain.buffer_updates)
    assert list(variant.graph) == list(fresh) and variant.graph.outputs == fresh.outputs
    known = unchanged_ops(plain.gm.graph, plain.graph, variant.gm.graph)
    ops = sum(1 for _ in variant.graph.ops())
    assert ops / 2 < len(known) < ops              # reused, and not everything


def test_an_op_whose_argument_or_input_changed_is_described_again(captures):
    """A constant argument changed, an input rewired: neither op is reused, nor is one
    whose input kept its name but holds another value."""
    from torchalpa.frontends.block_remat import copied_codegen
    from torchalpa.frontends.torch_export import unchanged_ops
    _, _, c = captures
    plain = c["none"]
    old = plain.gm.graph
    graph = torch.fx.Graph()
    graph._codegen = copied_codegen(old._codegen)
    graph.output(graph.graph_copy(old, {}))
    ops = [n for n in graph.nodes if n.op == "call_function" and n.name in plain.graph]
    scaled, i = next((n, i) for n in ops for i, a in enumerate(n.args)
                     if type(a) in (int, float))
    scaled.args = tuple(a * 2 + 1 if j == i else a for j, a in enumerate(scaled.args))
    two = [n for n in ops if len(n.all_input_nodes) == 2 and n is not scaled]
    rewired = two[-1]
    a, b = rewired.all_input_nodes
    rewired.args = tuple(b if x is a else x for x in rewired.args)
    revalued = two[0]
    revalued.meta = dict(revalued.meta, val=revalued.meta["val"].clone())
    known = unchanged_ops(old, plain.graph, graph)
    assert scaled.name not in known and rewired.name not in known
    assert revalued.name not in known        # its value is another object
    readers = [u.name for u in revalued.users if u.name in plain.graph]
    assert readers and not set(readers) & set(known)
    untouched = {n.name for n in ops if n not in (scaled, rewired, revalued)
                 and revalued not in n.all_input_nodes}
    assert untouched <= set(known)
