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
    # a tensor over the bound (the memory model's too: core/optimizer_step.py): the loop
    from torchalpa.core import optimizer_step
    monkeypatch.setattr(optimizer_step, "FOREACH_MAX_NUMEL", 8)
    pm.train_step(x, y)
    assert calls[-1] == "_single_tensor_adam"


@pytest.mark.usefixtures("single_process_world")
def test_the_kept_local_view_follows_loads_and_replaced_states():
    """The local view kept between steps must not go stale: after ``load_state_dict`` (a new
    state dict) or a state entry the user replaced, the next step uses what the optimizer
    holds now, exactly as a plain optimizer over plain tensors does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    ref.load_state_dict(model.state_dict())
    batches = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(5)]
    pm = torchalpa.auto_parallel(model, batches[0], F.mse_loss,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2),
                                 method=torchalpa.ShardParallel())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)

    def ref_step(x, y):
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()

    pm.train_step(*batches[0])
    ref_step(*batches[0])
    saved, ref_saved = pm.optimizer.state_dict(), ref_opt.state_dict()
    for x, y in batches[1:3]:
        pm.train_step(x, y)
        ref_step(x, y)
    pm.optimizer.load_state_dict(saved)            # back to the state after step one
    ref_opt.load_state_dict(ref_saved)
    pm.train_step(*batches[3])
    ref_step(*batches[3])
    p0, r0 = next(iter(pm.optimizer.state)), next(iter(ref_opt.state))
    pm.optimizer.state[p0]["exp_avg"] = pm.optimizer.state[p0]["exp_avg"] * 0   # replaced
    ref_opt.state[r0]["exp_avg"] = ref_opt.state[r0]["exp_avg"] * 0
    pm.train_step(*batches[4])
    ref_step(*batches[4])
    for (name, p), (_, r) in zip(pm.named_parameters(), ref.named_parameters()):
        local = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(local, r, rtol=1e-5, atol=1e-6, msg=name)
    for state in pm.optimizer.state.values():
        assert all(not isinstance(v, torch.Tensor) or v.dim() == 0 or hasattr(v, "placements")
                   for v in state.values())
