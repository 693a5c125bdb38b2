"""On a CUDA device: the zoo trains under torchalpa like eager PyTorch (``make test-gpu``).

Marked ``gpu``: skipped without CUDA (tests/conftest.py) and left out of ``make test``. One
process, one GPU (NCCL refuses two ranks on one GPU, so multi-rank NCCL is not tested
here). Dropout is switched off so both sides compute the same function; in fp32 (TF32
off, PyTorch's default) losses agree within 1e-5 relative.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.cluster import Cluster

pytestmark = [pytest.mark.gpu,
              pytest.mark.usefixtures("single_process_world")]   # conftest.py


@pytest.fixture(autouse=True)
def _on_cuda(monkeypatch):
    """The rest of the suite runs on CPUs (conftest.py sets TORCHALPA_DEVICE=cpu); these
    tests are about the GPU."""
    monkeypatch.setenv("TORCHALPA_DEVICE", "cuda")

FAMILIES = ["gpt", "llama", "bert", "vit", "resnet", "moe", "hf_gpt2", "hf_llama", "hf_bert"]
STEPS = 3


def _without_dropout(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def _workload(family: str, batch_size: int = 4):
    if family.startswith("hf_"):
        pytest.importorskip("transformers")
    workload = zoo.tiny(family, batch_size=batch_size)
    config = workload.config
    if dataclasses.is_dataclass(config) and any(f.name == "dropout"
                                                for f in dataclasses.fields(config)):
        workload = zoo.tiny(family, batch_size=batch_size, dropout=0.0)
    return workload


def _twins(workload, device="cuda"):
    torch.manual_seed(0)
    model = _without_dropout(workload.build()).to(device)
    torch.manual_seed(0)
    ref = _without_dropout(workload.build()).to(device)
    torch.manual_seed(1234)
    batch = tuple(x.to(device) for x in workload.example_inputs())
    return model, ref, batch


@pytest.mark.parametrize("family", FAMILIES)
def test_zoo_trains_on_cuda_like_eager(family):
    workload = _workload(family)
    model, ref, batch = _twins(workload)
    pm = torchalpa.auto_parallel(model, batch, workload.loss_fn,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                 method=torchalpa.ShardParallel())
    assert pm.plan.unsupported_ops == ()
    assert "_for_cpu" not in pm.local_program()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(STEPS):
        loss = pm.train_step(*batch)
        ref_loss = workload.loss_fn(ref(*batch[:-1]), batch[-1])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert loss.device.type == "cuda"
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5), f"step {step}"


def test_learned_attention_bias_trains_on_cuda():
    from test_attention import BiasedAttention
    torch.manual_seed(0)
    model = BiasedAttention().cuda()
    torch.manual_seed(0)
    ref = BiasedAttention().cuda()
    x, y = torch.randn(4, 8, 16, device="cuda"), torch.randn(4, 8, 16, device="cuda")
    pm = torchalpa.auto_parallel(model, (x, y), nn.functional.mse_loss,
                                 method=torchalpa.ShardParallel())
    loss = pm(x, y)
    loss.backward()
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    for p, q in zip(pm.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt", "resnet"])
def test_bf16_mixed_precision_tracks_eager_autocast(family):
    workload = _workload(family)
    model, ref, batch = _twins(workload)
    policy = torchalpa.MixedPrecision(param_dtype=torch.bfloat16)
    pm = torchalpa.auto_parallel(model, batch, workload.loss_fn, mixed_precision=policy,
                                 method=torchalpa.ShardParallel())
    loss = pm(*batch)
    loss.backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_loss = workload.loss_fn(ref(*batch[:-1]), batch[-1])
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=2e-2)


def test_compiled_programs_train_like_eager():
    workload = _workload("llama")
    model, ref, batch = _twins(workload)
    pm = torchalpa.auto_parallel(model, batch, workload.loss_fn, compile=True,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-2),
                                 method=torchalpa.ShardParallel())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    for _ in range(2):
        loss = pm.train_step(*batch)
        ref_loss = workload.loss_fn(ref(*batch[:-1]), batch[-1])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-4)


def test_detect_describes_this_gpu():
    c = Cluster.detect(1, 1)
    free, total = torch.cuda.mem_get_info()
    assert c.device_name == torch.cuda.get_device_name()
    assert 0 < c.memory_per_device < total
    assert c.backend == "nccl" and c.kernel_launch_s > 0
    workload = _workload("llama")
    with torch.device("meta"):
        model = workload.build()
    plan = torchalpa.plan(model, workload.example_inputs(device="meta"), workload.loss_fn,
                          method=torchalpa.ShardParallel())
    assert f"planned for {c.device_name}" in plan.summary()
