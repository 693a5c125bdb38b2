"""Calling conventions (``torchalpa/core/calls.py``), the forward-only capture, kernels whose
fake implementation is stricter than the real one, and the hints of capture errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchalpa.core.calls import CallSignature
from torchalpa.frontends.opset import _grouped_mm
from torchalpa.frontends.torch_export import CaptureError, capture, capture_forward

transformers = pytest.importorskip("transformers")


def tiny_llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1)    # use_cache left at its default
    return transformers.LlamaForCausalLM(config)


def test_signature_of_a_keyword_batch():
    ids = torch.zeros(2, 4, dtype=torch.long)
    sig, tensors = CallSignature.of({"input_ids": ids, "use_cache": False, "labels": ids})
    assert sig.keywords == ("input_ids", "labels") and dict(sig.static) == {"use_cache": False}
    assert len(tensors) == 2 and sig.names(2) == ["input_ids", "labels"]
    assert sig.flatten((), {"labels": ids, "input_ids": ids}) == [ids, ids]
    with pytest.raises(TypeError, match="keyword"):
        sig.flatten((ids, ids), {})
    with pytest.raises(TypeError, match="missing"):
        sig.flatten((), {"input_ids": ids})
    with pytest.raises(ValueError, match="use_cache"):
        sig.flatten((), {"input_ids": ids, "labels": ids, "use_cache": True})
    positional, _ = CallSignature.of((ids, ids))
    with pytest.raises(TypeError, match="dict"):
        positional.flatten((), {"input_ids": ids})


def test_a_keyword_batch_captures_the_models_own_loss_with_default_config():
    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(64, (2, 6))
    c = capture(model, {"input_ids": ids, "labels": ids})
    assert [c.graph.node(n).target for n in c.graph.inputs] == ["input_ids", "labels"]
    assert not [n for n in c.gm.graph.nodes if n.op == "get_attr"]   # the KV cache's tensors
    params = [model.get_parameter(k).detach() for k in c.param_names]
    buffers = [dict(model.named_buffers())[k] for k in c.buffer_names]
    loss = c.gm(params, buffers, ids, ids)[0]
    torch.testing.assert_close(loss, model(input_ids=ids, labels=ids).loss)
    assert c.signature.wrap_loss(loss).loss is loss      # the forward's output type


def test_labels_given_by_position_are_explained():
    model = tiny_llama()
    ids = torch.randint(64, (2, 6))
    with pytest.raises(CaptureError, match=r"example_inputs\[2\] -> position_ids.*dict"):
        capture(model, (ids, torch.ones_like(ids), ids))


def test_forward_capture_in_train_mode_records_buffer_updates():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    fc = capture_forward(model, [torch.empty(8, 4, device="meta")], outputs=True)
    assert fc.buffer_updates == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]


def test_forward_capture_failures_are_capture_errors():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return h * 2 if h.sum() > 0 else h     # reads a value: cannot be captured

    with pytest.raises(CaptureError, match="test_calls.py.*\n.*\nhint: .*tensor values"):
        capture_forward(Branchy().eval(), [torch.empty(2, 4, device="meta")], outputs=True)


def test_transformer_mask_detection_hint_says_is_causal():
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    mask = torch.triu(torch.full((4, 4), float("-inf")), diagonal=1)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = encoder

        def forward(self, x):
            return self.encoder(x, mask=mask).sum()

    with pytest.raises(CaptureError, match="is_causal=True"):
        capture(Model(), (torch.randn(2, 4, 8),))


@pytest.mark.parametrize("shapes", [((6, 4), (3, 4, 8)), ((4, 8), (8, 4)), ((3, 4, 4), (4, 8))])
def test_grouped_mm_decomposition_equals_the_cpu_kernel(shapes):
    torch.manual_seed(0)
    a, b = torch.randn(*shapes[0]), torch.randn(*shapes[1])
    offs = torch.tensor([2, 4, 6] if a.dim() == 2 and b.dim() == 3 else [2, 4, 8],
                        dtype=torch.int32)
    torch.testing.assert_close(_grouped_mm(a, b, offs), torch._grouped_mm(a, b, offs=offs))


def test_float32_grouped_mm_captures_and_a_refusing_meta_kernel_is_named():
    class Experts(nn.Module):
        def __init__(self, out_dtype=None):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 4, 8))
            self.out_dtype = out_dtype

        def forward(self, x):
            offs = torch.tensor([3, 6], dtype=torch.int32)
            y = torch._grouped_mm(x, self.w, offs=offs, out_dtype=self.out_dtype)
            return F.silu(y.float()).sum()

    torch.manual_seed(0)
    model, x = Experts(), torch.randn(6, 4)
    c = capture(model, (x,))
    loss, grad = c.gm([model.w.detach()], [], x)
    model(x).backward()
    torch.testing.assert_close(loss, model(x))
    torch.testing.assert_close(grad, model.w.grad)
    with pytest.raises(CaptureError, match=r"fake \(meta\) kernel of aten._grouped_mm"):
        capture(Experts(out_dtype=torch.bfloat16), (x,))
