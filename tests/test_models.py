"""The model zoo captures on meta, and its joint graphs are right: values, flops, tags."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torchalpa.models as models
from torchalpa.frontends.repeated import block_counts
from torchalpa.frontends.torch_export import capture, split_inputs

FAMILIES = sorted(models.FAMILIES)
aten = torch.ops.aten


def capture_on_meta(workload):
    with torch.device("meta"):
        model = workload.build()
        batch = workload.example_inputs()
    return model, capture(model, batch, workload.loss_fn)


@pytest.fixture(scope="module")
def captured():
    """Every tiny zoo model captured once on meta: family -> (model, Capture)."""
    return {family: capture_on_meta(models.tiny(family)) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_model_captures_on_meta(captured, family):
    model, c = captured[family]
    g = c.graph
    g.check()
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert list(g.params) == trainable and set(g.grads) == set(trainable)
    ops = list(g.ops())
    assert {n.phase for n in ops} == {"forward", "backward"}
    assert g.node(g.outputs.loss.node).phase == "forward"
    # views share their operand's storage: they move no bytes, every other op does
    views = [n for n in ops if n.aliases]
    assert views and all(n.bytes == 0 and n.operands for n in views)
    assert all(n.op != "aten.view.default" and n.bytes > 0 for n in ops if not n.aliases)


@pytest.mark.parametrize("family", FAMILIES)
def test_module_paths_name_real_modules_forward_and_backward(captured, family):
    model, c = captured[family]
    modules = dict(model.named_modules())
    ops = list(c.graph.ops())
    assert all(n.module in modules for n in ops), {n.module for n in ops} - set(modules)
    for phase in ("forward", "backward"):
        matmuls = [n for n in ops if n.phase == phase and n.op in (
            "aten.mm.default", "aten.convolution.default", "aten.convolution_backward.default")]
        assert matmuls and all(n.module for n in matmuls), (phase, family)
    # the user's source line is recorded, forward and backward (HF: transformers' file)
    source = "transformers/" if family.startswith("hf_") else "torchalpa/models/"
    lines = [n.stack for n in ops if n.op == "aten.mm.default"]
    assert all(line and source in line and line.rsplit(":", 1)[1].isdigit() for line in lines)


def _run_captured(c, model, batch):
    params = [model.get_parameter(name).detach() for name in c.param_names]
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    buffers = [state[name].detach().clone() for name in c.buffer_names]
    out = c.gm(params, buffers, *batch)
    n = len(params)
    return out[0], dict(zip(c.param_names, out[1:1 + n])), dict(zip(c.buffer_updates, out[1 + n:]))


NO_DROPOUT = {"gpt": dict(dropout=0.0), "bert": dict(dropout=0.0),
              "hf_gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}


@pytest.mark.parametrize("family", ["gpt", "llama", "resnet", "moe", "hf_gpt2"])
def test_captured_step_computes_what_eager_autograd_computes(family):
    """Loss, every gradient and every buffer update equal eager PyTorch's."""
    torch.manual_seed(0)
    workload = models.tiny(family, **NO_DROPOUT.get(family, {}))
    model = workload.build()
    batch = workload.example_inputs()
    c = capture(model, batch, workload.loss_fn)
    loss, grads, updates = _run_captured(c, model, batch)
    inputs, targets = split_inputs(batch, workload.loss_fn)
    ref_loss = workload.loss_fn(model(*inputs), *targets)
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(grad, model.get_parameter(name).grad, atol=1e-6, rtol=1e-4), name
    buffers = dict(model.named_buffers())
    assert set(updates) == {k for k in buffers if k.rsplit(".", 1)[0] in _batch_norms(model)}
    for name, value in updates.items():
        assert torch.allclose(value.to(buffers[name].dtype), buffers[name]), name


def _batch_norms(model):
    return {name for name, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}


def test_resnet_records_batch_norm_buffer_updates(captured):
    model, c = captured["resnet"]
    g = c.graph
    norms = _batch_norms(model)
    expected = {f"{bn}.{b}" for bn in norms
                for b in ("running_mean", "running_var", "num_batches_tracked")}
    assert set(g.buffer_updates) == expected == set(c.buffer_updates)
    buffers = {n.target: n for n in g if n.kind == "buffer"}
    for fqn, ref in g.buffer_updates.items():
        assert g.spec(ref) == buffers[fqn].output
        node = g.node(ref.node)
        assert node.phase == "forward" and node.module == fqn.rsplit(".", 1)[0]
        assert node.op == ("aten.add.Tensor" if fqn.endswith("num_batches_tracked")
                           else "aten.copy.default")
    # training-mode batch norm is one functional op per module, with its backward
    ops = [n.op for n in g.ops()]
    assert ops.count("aten._native_batch_norm_legit_functional.default") == len(norms)
    assert ops.count("aten.native_batch_norm_backward.default") == len(norms)
    assert not any(op.endswith("_.default") or "_.Tensor" in op for op in ops)  # no in-place


def test_tied_embedding_is_one_parameter_with_one_summed_gradient(captured):
    model, c = captured["gpt"]
    g = c.graph
    assert model.lm_head.weight is model.wte.weight
    assert "wte.weight" in g.params and "lm_head.weight" not in g.params
    grad = g.node(g.grads["wte.weight"].node)
    assert grad.op == "aten.add.Tensor" and grad.is_grad
    sources = {g.node(r.node).op for r in grad.operands}
    assert "aten.embedding_dense_backward.default" in sources   # the embedding's use
    assert "aten.permute.default" in sources or "aten.mm.default" in sources   # the head's


def test_dropout_is_native_dropout_the_only_random_op(captured):
    model, c = captured["gpt"]
    ops = [n.op for n in c.graph.ops()]
    num_dropouts = 1 + 3 * model.config.num_layers     # embeddings; attn, resid, mlp
    assert ops.count("aten.native_dropout.default") == num_dropouts
    assert ops.count("aten.native_dropout_backward.default") == num_dropouts
    assert not any("bernoulli" in op or "rand" in op for op in ops)


def test_llama_flops_are_exact(captured):
    model, c = captured["llama"]
    cfg = model.config
    B, T, C, H, D = 2, cfg.max_seq_len, cfg.hidden, cfg.num_heads, cfg.head_dim
    ops = list(c.graph.ops())
    q_proj = [n for n in ops
              if n.module == "layers.0.self_attn.q_proj" and n.op == "aten.mm.default"]
    fwd = [n for n in q_proj if n.phase == "forward"]
    assert len(fwd) == 1 and fwd[0].flops == 2 * (B * T) * C * C
    assert sorted(n.flops for n in q_proj if n.phase == "backward") == [2 * B * T * C * C] * 2
    down = next(n for n in ops if n.module == "layers.1.mlp.down_proj" and n.phase == "forward"
                and n.op == "aten.mm.default")
    assert down.flops == 2 * (B * T) * cfg.intermediate * C
    attn = [n for n in ops if n.op.startswith("torchalpa.sdpa") and n.module == "layers.0.self_attn"]
    assert {n.phase for n in attn} == {"forward", "backward"}
    # forward: QK^T and PV; backward: the forward again (torchalpa::sdpa_backward recomputes
    # it, torchalpa/ops/attention.py), then QK^T again (flash recomputes it) and the four
    # gradient matmuls; 2 flops per multiply-add, causal masking not discounted
    for n in attn:
        assert n.flops == (4 if n.phase == "forward" else 4 + 10) * B * H * T * T * D
    head = next(n for n in ops if n.module == "lm_head" and n.phase == "forward"
                and n.op == "aten.mm.default")
    assert head.flops == 2 * (B * T) * C * cfg.vocab_size


def test_resnet_conv_flops_are_exact(captured):
    model, c = captured["resnet"]
    cfg = model.config
    ops = list(c.graph.ops())
    stem = next(n for n in ops if n.module == "conv1" and n.op == "aten.convolution.default")
    B, S, Cout = 2, cfg.image_size, cfg.widths[0]
    assert stem.flops == 2 * B * Cout * S * S * cfg.channels * 3 * 3
    down = next(n for n in ops if n.module == "layer2.0.downsample.0"
                and n.op == "aten.convolution.default")
    assert down.flops == 2 * B * cfg.widths[1] * (S // 4) ** 2 * cfg.widths[0] * 1 * 1
    pool = next(n for n in ops if n.module == "maxpool" and n.phase == "forward")
    assert pool.op == "aten.max_pool2d_with_indices.default"
    assert pool.outputs[0].shape == (B, Cout, S // 2, S // 2)


def test_moe_routes_with_topk_and_einsum_and_adds_the_aux_loss(captured):
    model, c = captured["moe"]
    cfg = model.config
    ops = list(c.graph.ops())
    moe_ops = {n.op for n in ops if n.module == "blocks.0.moe"}
    assert {"aten.topk.default", "aten.cumsum.default", "aten.bmm.default"} <= moe_ops
    B, T = 2, cfg.max_seq_len
    cap = model.blocks[0].moe.capacity(B * T)
    expert_mm = [n for n in ops if n.module == "blocks.0.moe" and n.op == "aten.bmm.default"
                 and n.phase == "forward" and n.outputs[0].shape == (cfg.num_experts, cap,
                                                                     cfg.intermediate)]
    assert len(expert_mm) == 1
    assert expert_mm[0].flops == 2 * cfg.num_experts * cap * cfg.hidden * cfg.intermediate
    # the router gets gradients through the combine weights and the load-balancing loss
    assert "blocks.0.moe.router.weight" in c.graph.grads


@pytest.mark.parametrize("family,container", [
    ("gpt", "h"), ("llama", "layers"), ("bert", "encoder.layer"), ("vit", "blocks"),
    ("moe", "blocks"), ("hf_gpt2", "transformer.h"), ("hf_llama", "model.layers"),
    ("hf_bert", "bert.encoder.layer")])
def test_repeated_blocks_found_with_the_right_count(family, container):
    layers_field = {"hf_gpt2": "n_layer", "hf_llama": "num_hidden_layers",
                    "hf_bert": "num_hidden_layers"}.get(family, "num_layers")
    model, c = capture_on_meta(models.tiny(family, **{layers_field: 3}))
    tags = c.graph.meta["repeated_blocks"]
    assert block_counts(tags) == {container: 3}
    # every op and parameter of layer 1 is tagged, forward and backward alike
    layer1 = [n for n in c.graph if (n.module if n.kind == "op" else n.target or ""
                                     ).startswith(f"{container}.1.")]
    assert layer1 and all(tags[n.name] == (container, 1) for n in layer1)
    assert {n.phase for n in layer1 if n.kind == "op"} == {"forward", "backward"}
    assert not any(n.module.startswith("lm_head") or n.module == "" for n in c.graph.ops()
                   if n.name in tags)


def test_resnet_tags_only_the_identical_blocks(captured):
    model, c = captured["resnet"]
    # layer1's two blocks are alike; layer2.0 downsamples, so layer2 has no repeated pair
    assert block_counts(c.graph.meta["repeated_blocks"]) == {"layer1": 2}


def test_big_presets_have_the_issue_shapes():
    w = models.llama2_13b()
    assert (w.config.hidden, w.config.num_layers, w.config.num_heads, w.config.intermediate,
            w.config.vocab_size, w.seq_len, w.batch_size) == (5120, 40, 40, 13824, 32000, 4096, 8)
    w = models.llama3_8b()
    assert (w.config.num_layers, w.config.hidden, w.config.num_heads, w.config.num_kv_heads,
            w.config.intermediate, w.config.vocab_size, w.seq_len, w.batch_size
            ) == (32, 4096, 32, 8, 14336, 128256, 8192, 16)
    w = models.gpt_39b()
    assert (w.config.num_layers, w.config.hidden, w.config.num_heads, w.seq_len) == \
        (48, 8192, 64, 1024)
    with torch.device("meta"):
        model = w.replace(num_layers=1).build()
        (idx, targets) = w.example_inputs()
    assert idx.shape == targets.shape == (1024, 1024)
    assert sum(p.numel() for p in model.parameters()) > 8192 * 51200   # one layer + embeddings


@pytest.mark.parametrize("name, size, batch", [("llama3_70b", 70.55e9, 128),
                                               ("llama3_405b", 405.85e9, 64)])
def test_the_large_llama_sizes_have_their_published_parameter_counts(name, size, batch):
    w = models.named(name)
    with torch.device("meta"):
        model = w.build()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(size, rel=1e-4)
    assert (w.batch_size, w.seq_len, w.config.num_kv_heads) == (batch, 8192, 8)


def test_llama3_uses_grouped_query_attention():
    model, c = capture_on_meta(models.tiny("llama", num_kv_heads=1))
    k_proj = model.layers[0].self_attn.k_proj
    assert k_proj.out_features == model.config.head_dim
    attn = next(n for n in c.graph.ops() if n.op == "torchalpa.sdpa.default")
    q, k = (c.graph.spec(r) for r in attn.operands[:2])
    assert q.shape == k.shape    # kv heads repeated to the query heads before attention


def test_configs_reject_bad_fields():
    with pytest.raises(ValueError, match="hidden=30 must be divisible by num_heads=4"):
        models.LlamaConfig.tiny(hidden=30)
    with pytest.raises(ValueError, match="num_heads=4 must be divisible by num_kv_heads=3"):
        models.LlamaConfig.tiny(num_kv_heads=3)
    with pytest.raises(ValueError, match="GPTConfig.dropout"):
        models.GPTConfig.tiny(dropout=1.5)
    with pytest.raises(ValueError, match="top_k=5 must be <= num_experts=4"):
        models.MoEConfig.tiny(top_k=5)
    with pytest.raises(ValueError, match="unknown model family"):
        models.tiny("gpt5")
    with pytest.raises(dataclasses.FrozenInstanceError):
        models.GPTConfig.tiny().hidden = 64     # frozen


def test_tiny_configs_have_dims_divisible_by_8():
    for family in ("gpt", "llama", "bert", "vit", "moe"):
        cfg = models.tiny(family).config
        assert cfg.hidden % 8 == 0 and cfg.num_layers <= 4


def test_hf_model_output_reaches_the_loss_fn():
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutputWithPast
    seen = []

    def loss_fn(output, labels):
        seen.append(type(output))
        return models.hf.causal_lm_loss(output, labels)

    w = models.tiny("hf_llama")
    with torch.device("meta"):
        model, batch = w.build(), w.example_inputs()
    c = capture(model, batch, loss_fn)
    assert seen == [CausalLMOutputWithPast]
    assert c.graph.spec(c.graph.outputs.loss).shape == ()


def test_ops_keep_positional_outputs_with_absent_ones(captured):
    """The stem conv's backward makes no input gradient (the images need none) and no bias
    gradient: those outputs are placeholders, so output 1 is still the weight gradient."""
    model, c = captured["resnet"]
    g = c.graph
    ref = g.grads["conv1.weight"]
    node = g.node(ref.node)
    assert node.op == "aten.convolution_backward.default" and ref.index == 1
    assert [o.is_absent for o in node.outputs] == [True, False, True]
    assert node.outputs[1].shape == tuple(model.conv1.weight.shape)
    assert node.outputs[0].nbytes == 0 and str(node.outputs[0]) == "none"


def test_frozen_embedding_gets_no_gradient():
    w = models.tiny("gpt")
    with torch.device("meta"):
        model, batch = w.build(), w.example_inputs()
    model.wpe.weight.requires_grad_(False)
    c = capture(model, batch, w.loss_fn)
    assert "wpe.weight" not in c.graph.params and "wpe.weight" in c.buffer_names
    assert not any(n.op == "aten.embedding_dense_backward.default" and n.module == "wpe"
                   for n in c.graph.ops())
    assert c.buffer_updates == []


def test_lm_loss_ignores_targets_of_minus_100():
    logits = torch.randn(2, 4, 8)
    targets = torch.tensor([[1, 2, -100, 3], [-100, -100, 5, 6]])
    keep = targets != -100
    expected = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    assert torch.allclose(models.lm_loss(logits, targets), expected)
    assert not torch.allclose(models.lm_loss(logits, targets.clamp(min=0)), expected)
