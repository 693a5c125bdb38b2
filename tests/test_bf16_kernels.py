"""A bf16 step launches no more kernels than eager autocast does.

On an H200, BERT, ViT and the small GPT ran 1.4-1.5x eager autocast in bf16 and within 6%
in float32 (benchmarks/one_gpu.py). The op stream is one cause that a CPU can see: the
count of the ATen kernels one training step runs (views excluded), per layer -- the
difference between the zoo model at 3 and at 2 layers, so the fixed parts (embeddings,
the loss, the optimizer) drop out. Eager runs on the CPU under CUDA autocast's policy:
CPU autocast already casts matmuls, convolutions and attention to bf16 like CUDA's, and
``cuda_autocast_policy`` adds what only CUDA's runs in float32 (layer norm, softmax,
log-softmax, the loss, pointwise transcendental ops), so its casts are the ones a GPU
pays. What the counts could not explain needs a GPU: benchmarks/bf16_profile.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import torchalpa
import torchalpa.models as zoo

aten = torch.ops.aten
_NO_KERNEL = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand",
              "unsqueeze", "squeeze", "split", "split_with_sizes", "slice", "select", "alias",
              "as_strided", "detach", "unbind", "_reshape_alias", "lift_fresh", "empty",
              "empty_strided", "empty_like", "new_empty", "new_empty_strided",
              "_local_scalar_dense", "_record_function_enter_new", "_record_function_exit"}


class KernelCount(TorchDispatchMode):
    """Counts the ATen calls that launch a kernel (views and bookkeeping excluded)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "prim" and func._schema.name.split("::")[-1] not in _NO_KERNEL:
            self.total += 1
        return func(*args, **(kwargs or {}))


_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_FP32 = ("native_layer_norm", "exp", "log", "rsqrt", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
         "reciprocal", "mse_loss", "nll_loss")
_FP32_OPT_DTYPE = ("softmax.int", "log_softmax.int", "sum", "sum.dim_IntList", "cumsum")


@pytest.fixture
def cuda_autocast_policy():
    """CPU autocast casting like CUDA's: the float32 ops above registered on AutocastCPU
    (``fp32``: floating arguments cast up; ``fp32_set_opt_dtype``: ``dtype=float32``);
    removed after the test."""
    lib = torch.library.Library("aten", "IMPL")

    def up(x):
        return x.float() if isinstance(x, torch.Tensor) and x.dtype in (
            torch.bfloat16, torch.float16) else x

    def kernel(op, opt_dtype):
        def run(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                if opt_dtype:
                    if args[0].dtype != torch.float32 and kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
                else:
                    args, kwargs = torch.utils._pytree.tree_map(up, (args, kwargs))
                return op(*args, **kwargs)
        return run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # overriding autocast's own registrations
        for name in _FP32 + _FP32_OPT_DTYPE:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(aten, packet), overload or "default")
            lib.impl(name, kernel(op, name in _FP32_OPT_DTYPE), "AutocastCPU")
    yield
    lib._destroy()


_TINY = {
    "bert": dict(vocab_size=128, max_seq_len=32, hidden=32, num_heads=2, intermediate=64,
                 dropout=0.0),
    "vit": dict(image_size=16, patch_size=8, hidden=32, num_heads=2, num_classes=10,
                dropout=0.0),
    "gpt": dict(vocab_size=128, max_seq_len=32, num_heads=2, hidden=32, dropout=0.0),
}


def _workload(family: str, layers: int) -> zoo.Workload:
    config = zoo.FAMILIES[family].tiny_config(num_layers=layers, **_TINY[family])
    return zoo.Workload(family, config, 2, None)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def eager_kernels(family: str, layers: int) -> int:
    """Kernels of one eager step under autocast(bf16) (after one warm-up step)."""
    w = _workload(family, layers)
    torch.manual_seed(0)
    model, batch = w.build(), w.example_inputs()
    opt = _adamw(model.parameters())

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = w.loss_fn(model(*batch[:-1]), batch[-1])
        loss.backward()
        opt.step()
    step()
    count = KernelCount()
    with count:
        step()
    return count.total


def torchalpa_kernels(family: str, layers: int) -> int:
    """Kernels of one ``train_step`` with bf16 mixed precision (after one warm-up step)."""
    w = _workload(family, layers)
    torch.manual_seed(0)
    model, batch = w.build(), w.example_inputs()
    pm = torchalpa.auto_parallel(model, batch, w.loss_fn, optimizer=_adamw,
                                 mixed_precision=torchalpa.MixedPrecision())
    pm.train_step(*batch)
    count = KernelCount()
    with count:
        pm.train_step(*batch)
    return count.total


@pytest.mark.usefixtures("single_process_world", "cuda_autocast_policy")
@pytest.mark.parametrize("family", ["bert", "vit", "gpt"])
def test_a_bf16_layer_launches_no_more_kernels_than_eager_autocast(family):
    eager = eager_kernels(family, 3) - eager_kernels(family, 2)
    ours = torchalpa_kernels(family, 3) - torchalpa_kernels(family, 2)
    # +2: a layer norm's weight and bias gradients are cast back to float32 (eager
    # autocast runs layer norm in float32 and casts its activations instead)
    assert ours <= eager + 2, f"{family}: {ours} kernels per layer, eager autocast {eager}"


@pytest.mark.usefixtures("single_process_world")
def test_a_linear_bias_is_added_inside_its_gemm():
    """``add(mm(x, w.T), b)`` runs as ``addmm`` (F.linear's kernel), in bf16 and fp32."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    for policy in (torchalpa.MixedPrecision(), None):
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, mixed_precision=policy)
        forward = pm.local_program().split("# backward")[0]
        assert forward.count("aten.addmm.default(") == 2, forward
        assert "aten.mm.default(" not in forward


@pytest.mark.usefixtures("single_process_world")
def test_casts_take_only_their_dtype():
    """A cast in a lowered program names its dtype only: ``device=`` and ``layout=`` (which
    a cast's backward records) send ``_to_copy`` down PyTorch's slower argument path, and
    every tensor of a local program is on the rank's device already."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss,
                                 mixed_precision=torchalpa.MixedPrecision())
    casts = [line for line in pm.local_program().splitlines() if "_to_copy" in line]
    assert casts, "a bf16 step casts its parameters and gradients"
    assert not [c for c in casts if "device =" in c or "layout =" in c], casts
