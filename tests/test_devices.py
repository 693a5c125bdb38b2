"""CPU-only CI catches programs that could not run on a GPU (runtime/lowering/device_ops.py).

The zoo's training steps are captured on ``meta``, planned, lowered for ``cuda`` and run
on fake CUDA tensors (``FakeTensorMode`` makes ``cuda`` tensors in the CPU build): every
op must have a kernel for CUDA, and no op may mix a CPU tensor into CUDA work (fake
tensors refuse that as CUDA would). The op that broke every attention model on an H100 --
the CPU flash-attention kernel, baked in by a trace on CPU -- is refused with its name.

(The joint capture itself cannot run on fake CUDA tensors in a CPU build: autograd asks
for a CUDA device guard when a parameter requires a gradient; capture says so.)
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from torchalpa.core.cluster import Cluster
from torchalpa.core.options import ShardParallel
from torchalpa.frontends import opset
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel.shard import candidate_meshes, plan_graph
from torchalpa.runtime.lowering.device_ops import DeviceOpError, runs_on
from torchalpa.runtime.lowering.lower import lower

aten = torch.ops.aten
models = pytest.importorskip("torchalpa.models")


def _lower_for(workload, device: str, mesh=(1,)):
    with torch.device("meta"):
        model = workload.build()
        batch = workload.example_inputs(device="meta")
    step = capture(model, batch, workload.loss_fn)
    method = ShardParallel(logical_mesh_shape=mesh)
    meshes = candidate_meshes(Cluster.local_cpu(mesh[0]), method)
    plan = plan_graph(step.graph, method=method, meshes=meshes)
    program = lower(step.gm, plan, step.param_names, coords=(0,) * len(mesh),
                    group_names=("g",) * len(mesh), device=torch.device(device),
                    buffer_updates=step.buffer_updates)
    return model, batch, step, program


def _run_on_fake(model, batch, step, program, device: str):
    """One forward and backward of the local program on fake ``device`` tensors."""
    with FakeTensorMode(allow_non_fake_inputs=False):
        def fake(t):
            return torch.empty(t.shape, dtype=t.dtype, device=device)
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        leaves = [fake(state[k]) for k in step.param_names + step.buffer_names]
        outs = program.forward(*leaves, *[fake(x) for x in batch])
        loss, saved = outs[0], outs[1 + len(program.buffer_updates):]
        grads = program.backward(*saved)
    return loss, grads


@pytest.mark.parametrize("family", ["llama", "bert", "vit", "moe", "gpt", "resnet"])
def test_zoo_programs_lowered_for_cuda_run_on_fake_cuda(family):
    model, batch, step, program = _lower_for(models.tiny(family), "cuda")
    loss, grads = _run_on_fake(model, batch, step, program, "cuda")
    assert loss.device.type == "cuda" and loss.numel() == 1
    real = [g for g in grads if g is not None]
    assert len(real) == len(step.param_names)
    assert all(g.device.type == "cuda" for g in real)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["hf_llama", "hf_gpt2", "hf_bert"])
def test_hf_programs_lowered_for_cuda_run_on_fake_cuda(family):
    pytest.importorskip("transformers")
    model, batch, step, program = _lower_for(models.tiny(family), "cuda")
    loss, _ = _run_on_fake(model, batch, step, program, "cuda")
    assert loss.device.type == "cuda"


def _cpu_flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    """How torchalpa captured attention before torchalpa::sdpa: the CPU kernel."""
    return aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]


def test_cpu_attention_kernel_in_a_program_for_cuda_is_refused():
    with mock.patch.object(opset, "_sdpa", _cpu_flash_sdpa):
        with pytest.raises(DeviceOpError) as e:
            _lower_for(models.tiny("llama"), "cuda")
    message = str(e.value)
    assert "_scaled_dot_product_flash_attention_for_cpu" in message
    assert "program for cuda" in message and "cpu only" in message
    assert "layers.0.self_attn" in message           # where the model made it
    assert "torchalpa::sdpa" in message               # and what to do instead


def test_the_same_program_lowered_for_cpu_is_accepted():
    with mock.patch.object(opset, "_sdpa", _cpu_flash_sdpa):
        _, _, step, program = _lower_for(models.tiny("llama"), "cpu")
    assert "_scaled_dot_product_flash_attention_for_cpu" in program.forward.code


def test_device_specific_ops_by_name_and_by_dispatcher():
    assert runs_on(aten._scaled_dot_product_flash_attention_for_cpu.default, "cpu")[0]
    assert not runs_on(aten._scaled_dot_product_flash_attention_for_cpu.default, "cuda")[0]
    assert not runs_on(aten._scaled_dot_product_flash_attention.default, "cpu")[0]
    assert not runs_on(aten.cudnn_convolution.default, "cpu")[0]
    assert not runs_on(aten.mkldnn_convolution.default, "cuda")[0]
    for op in (aten.mm.default, torch.ops.torchalpa.sdpa.default, aten.full.default,
               torch.ops._c10d_functional.all_reduce.default):
        assert runs_on(op, "cpu")[0] and runs_on(op, "cuda")[0], op
    assert runs_on(aten._scaled_dot_product_flash_attention_for_cpu.default, "meta")[0]


def test_capture_of_fake_cuda_parameters_in_a_cpu_build_explains_itself():
    if torch.backends.cuda.is_built():
        pytest.skip("a CUDA build can capture on fake CUDA tensors")
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device="cuda")
        x = torch.empty(2, 4, device="cuda")
        with pytest.raises(ValueError, match="meta"):
            capture(model, (x, x), F.mse_loss)
