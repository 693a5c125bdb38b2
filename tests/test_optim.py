"""The lean optimizer step (runtime/execution/optim.py) on one rank: the same updates as on plain
tensors, DTensor parameters and states outside step(), other optimizers untouched."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from quickstart import MLP  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.runtime.execution import optim as lean  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_process_world")   # conftest.py


def train(make_opt, steps=3):
    torch.manual_seed(0)
    model = MLP(32, 2)
    torch.manual_seed(0)
    ref = MLP(32, 2)
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, optimizer=make_opt,
                                 method=torchalpa.ShardParallel())
    ref_opt = make_opt(ref.parameters())
    seen_local = []
    # a global pre-hook runs after ours (registered first): it sees what step() will see
    hook = register_optimizer_step_pre_hook(
        lambda opt, *_: seen_local.append((opt, type(opt.param_groups[0]["params"][0]))))
    try:
        for _ in range(steps):
            pm.train_step(x, y)
            ref_opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
    finally:
        hook.remove()
    diff = max((p.full_tensor() - q).abs().max().item()
               for p, q in zip(pm.parameters(), ref.parameters()))
    return pm, diff, [t for opt, t in seen_local if opt is pm.optimizer]


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
])
def test_elementwise_optimizers_step_on_local_tensors_with_the_same_result(make_opt):
    pm, diff, seen = train(make_opt)
    assert diff < 1e-6
    assert seen and all(t is torch.Tensor for t in seen)
    # outside step(): DTensor parameters and states, keyed by the parameters
    params = list(pm.parameters())
    assert all(isinstance(p, DTensor) for p in pm.optimizer.param_groups[0]["params"])
    assert set(map(id, pm.optimizer.state)) == set(map(id, params))
    for state in pm.optimizer.state.values():
        assert all(isinstance(v, DTensor) for v in state.values() if v.dim() > 0)
    assert all(p.grad is None or isinstance(p.grad, DTensor) for p in params)
    assert all(p._local_tensor.grad is None for p in params)


def test_other_optimizers_keep_the_dtensor_path():
    pm, diff, seen = train(lambda ps: torch.optim.Adadelta(ps, lr=1.0))
    assert diff < 1e-6
    assert seen and all(t is not torch.Tensor for t in seen)
    assert not lean._applies(pm.optimizer)


def test_a_step_that_raised_is_undone_by_the_next():
    pm, _, _ = train(lambda ps: torch.optim.Adam(ps, lr=1e-2), steps=1)
    opt = pm.optimizer
    lean._to_local(opt, (), {})                 # as if step() raised after the pre-hook
    assert all(not isinstance(p, DTensor) for p in opt.param_groups[0]["params"])
    opt.step()
    assert all(isinstance(p, DTensor) for p in opt.param_groups[0]["params"])
    assert set(map(id, opt.state)) == set(map(id, pm.parameters()))


def test_module_to_keeps_working_and_keeps_the_lean_step():
    """``pm.to(...)`` swaps DTensor parameters' contents (Module._apply), which a weakly
    referenced tensor refuses (HF Trainer moves every model this way)."""
    pm, _, _ = train(lambda ps: torch.optim.Adam(ps, lr=1e-2), steps=1)
    torch.__future__.set_swap_module_params_on_conversion(True)   # what DTensors get anyway
    try:
        pm.to(torch.float32)
        pm.to("cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert all(isinstance(p, DTensor) for p in pm.parameters())
    assert lean._applies(pm.optimizer)
