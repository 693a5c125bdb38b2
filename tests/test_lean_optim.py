"""The lean step's foreach choice (runtime/execution/optim.py): where the user left ``foreach`` open,
small CPU groups step with the foreach implementation, which must update bit for bit as
the per-parameter loop does, and leave the group's options as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
from torchalpa.runtime.execution import optim as lean

HYPER = {torch.optim.SGD: dict(lr=0.1, momentum=0.9, weight_decay=0.01),
         torch.optim.Adam: dict(weight_decay=0.1, amsgrad=True)}


@pytest.mark.parametrize("cls", lean.FOREACH_IDENTICAL, ids=lambda c: c.__name__)
def test_foreach_update_is_the_per_parameter_update_bit_for_bit(cls):
    torch.manual_seed(0)
    params = [torch.randn(s) for s in [(16, 8), (8,), (3, 2, 5)]]
    loop, multi = [p.clone() for p in params], [p.clone() for p in params]
    kw = HYPER.get(cls, {})
    opts = cls(loop, foreach=False, **kw), cls(multi, foreach=True, **kw)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for group, opt in zip((loop, multi), opts):
            for p, g in zip(group, grads):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(loop, multi):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("single_process_world")
def test_train_step_uses_foreach_on_small_tensors_and_restores_the_option(monkeypatch):
    import torch.optim.adam as adam_module
    calls = []
    for name in ("_multi_tensor_adam", "_single_tensor_adam"):
        real = getattr(adam_module, name)
        monkeypatch.setattr(adam_module, name, lambda *a, _r=real, _n=name, **k:
                            (calls.append(_n), _r(*a, **k))[1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
                                 method=torchalpa.ShardParallel())
    pm.train_step(x, y)
    assert calls == ["_multi_tensor_adam"]
    assert pm.optimizer.param_groups[0]["foreach"] is None
    assert "_torchalpa_foreach_set" not in pm.optimizer.state_dict()["param_groups"][0]
    monkeypatch.setattr(lean, "FOREACH_MAX_NUMEL", 8)      # a tensor over the bound: the loop
    pm.train_step(x, y)
    assert calls[-1] == "_single_tensor_adam"
