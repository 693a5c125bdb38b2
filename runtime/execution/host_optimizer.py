"""Optimizer states in host memory: the step runs on host copies (DeepSpeed's ZeRO-Offload).

A plan made with ``AutoShardingOption.offload`` counts only parameters and gradients on
the devices (``passes/pricing/offload_price.py`` prices the rest). ``host_optimizer`` builds the
user's optimizer over *host copies* of this rank's parameter blocks (each DTensor's local
tensor; pinned memory where CUDA is available, a separate CPU tensor on CPU), so its
states are made on the host too. Around each ``step()``, hooks on that optimizer

- before: copy each device gradient block to its host copy's ``.grad`` and drop the
  device gradient (its memory is free for the next step);
- after: copy each updated host block back into the device parameter's local tensor.

The update is the one the optimizer would make on the device blocks (an elementwise
optimizer over the same numbers), so training matches plain training; ``state_dict``,
LR schedulers and ``zero_grad`` work on the host optimizer as on any other. The copies run
one after the other after backward, as the planner prices them.

With the parameters offloaded too (``AutoShardingOption.offload_parameters``), the local
blocks themselves live in host memory (``parameters_to_host``, pinned where CUDA exists)
and backward already copied the gradients there (``runtime/rewrites/param_stream.py``): the
optimizer steps the blocks in place (``shared=True``), with nothing to copy either way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor

__all__ = ["offloads", "offloads_parameters", "host_optimizer", "parameters_to_host",
           "HOST_PAIRS", "over_parameters"]

HOST_PAIRS = "_torchalpa_host_pairs"
"""Attribute of a host optimizer: [(device parameter, its host copy)]."""


def offloads(plan) -> bool:
    """Whether ``plan`` keeps optimizer states in host memory."""
    method = getattr(plan, "method", {}) or {}
    return bool(method.get("offload") or
                (method.get("auto_sharding_option") or {}).get("offload"))


def offloads_parameters(plan) -> bool:
    """Whether ``plan`` keeps parameters and gradients in host memory too."""
    method = getattr(plan, "method", {}) or {}
    return bool(method.get("offload_parameters") or
                (method.get("auto_sharding_option") or {}).get("offload_parameters"))


def parameters_to_host(params: Iterable[torch.Tensor]) -> int:
    """Move each trainable DTensor's local block to host memory (pinned where CUDA exists;
    a separate CPU tensor without it); returns how many moved."""
    moved = 0
    for p in params:
        if isinstance(p, DTensor) and p.requires_grad:
            p._local_tensor = _host_copy(p._local_tensor).requires_grad_(False)
            moved += 1
    return moved


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _host_copy(local: torch.Tensor) -> torch.Tensor:
    """A host tensor holding ``local``'s values: pinned where CUDA exists, else a
    separate CPU tensor (never the device tensor itself)."""
    pin = torch.cuda.is_available()
    host = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
    host.copy_(local.detach())
    return host.requires_grad_(local.requires_grad)


def host_optimizer(factory: Callable[..., torch.optim.Optimizer],
                   params: Iterable[torch.Tensor], *, shared: bool = False
                   ) -> torch.optim.Optimizer:
    """``factory`` (the user's ``lambda ps: torch.optim.AdamW(ps, ...)``) over host copies
    of ``params``' local blocks, with the hooks that move gradients down and parameters up
    around its step; ``shared``: the local blocks are in host memory already and are
    stepped in place."""
    pairs = [(p, _local(p) if shared else _host_copy(_local(p))) for p in params]
    optimizer = factory([h for _, h in pairs])
    setattr(optimizer, HOST_PAIRS, pairs)
    optimizer.register_step_pre_hook(_gradients_to_host)
    optimizer.register_step_post_hook(_parameters_to_devices)
    return optimizer


def _gradients_to_host(optimizer, args, kwargs) -> None:
    for p, host in getattr(optimizer, HOST_PAIRS):
        if p.grad is None:
            host.grad = None
            continue
        grad = _local(p.grad)
        if host is _local(p) and grad.device == host.device:    # shared: on the host
            host.grad, p.grad = grad, None
            continue
        if host.grad is None or host.grad.shape != grad.shape:
            host.grad = torch.empty(grad.shape, dtype=grad.dtype, device="cpu",
                                    pin_memory=torch.cuda.is_available())
        host.grad.copy_(grad, non_blocking=True)
        p.grad = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()     # the host step reads what the copies wrote


def _parameters_to_devices(optimizer, args, kwargs) -> None:
    with torch.no_grad():
        for p, host in getattr(optimizer, HOST_PAIRS):
            if host is not _local(p):
                _local(p).copy_(host, non_blocking=True)


@contextmanager
def over_parameters(optimizer) -> Iterator[None]:
    """Within: a host optimizer seen as one over the module's DTensor parameters, its
    states DTensors laid out as their parameters (what DCP's ``get_state_dict`` /
    ``set_state_dict`` key by the module's names). On leaving, the states (those a load
    put there too) go back to the host blocks, and host copies take the device
    parameters' values (a load wrote those). Any other optimizer: nothing changes."""
    pairs = getattr(optimizer, HOST_PAIRS, None)
    if not pairs:
        yield
        return
    param_of = {id(h): p for p, h in pairs}
    groups = [list(g["params"]) for g in optimizer.param_groups]
    states = optimizer.state
    for g in optimizer.param_groups:
        g["params"] = [param_of[id(h)] for h in g["params"]]
    optimizer.state = defaultdict(dict, {
        param_of[id(h)]: {k: _as_dtensor(v, param_of[id(h)], h) for k, v in s.items()}
        for h, s in states.items()})
    try:
        yield
    finally:
        host_of = {id(p): h for p, h in pairs}
        back = defaultdict(dict)
        for p, s in optimizer.state.items():
            h = host_of[id(p)]
            back[h] = {k: _on_host(v, h) for k, v in s.items()}
        for g, params in zip(optimizer.param_groups, groups):
            g["params"] = params
        optimizer.state = back
        with torch.no_grad():
            for p, h in pairs:
                if h is not _local(p):
                    h.copy_(_local(p))


def _as_dtensor(v, p, host: torch.Tensor):
    """A state tensor shaped as its host block, as a DTensor laid out as ``p``."""
    if not isinstance(v, torch.Tensor) or not isinstance(p, DTensor) or v.shape != host.shape:
        return v                          # a step count, or a plain parameter's state
    return DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape,
                              stride=p.stride(), run_check=False)


def _on_host(v, host: torch.Tensor):
    """A state back in host memory as a plain tensor (a DTensor's local block)."""
    if not isinstance(v, torch.Tensor):
        return v
    local = _local(v)
    if local.dim() == 0 or local.device == host.device:
        return local
    return _host_copy(local)
