"""A lean optimizer step over DTensor parameters: the update runs on the local shards.

``pmodel.parameters()`` are DTensors, so any ``torch.optim`` optimizer works on them -- but
each of its foreach ops then goes through DTensor dispatch (sharding propagation, wrapping
of every result): Adam on a 256-wide MLP took 13.4 ms where the same update on plain
tensors takes 9.9 ms. For optimizers whose update is elementwise per parameter (SGD, Adam,
AdamW, ...), updating each rank's block on its own is the same update, since a gradient
always arrives in its parameter's layout (``runtime.execution.step``).

``lean_optimizer_steps(params)`` marks torchalpa's parameters and installs two global
optimizer step hooks (once per process). Around ``step()`` of an optimizer of a listed
class whose parameters are all marked, the pre-hook puts each parameter's local tensor
(with its local gradient, and its local optimizer states) in place of the DTensor; the
step then runs the foreach / fused kernels on plain tensors; the post-hook puts the
DTensors back, wrapping states the step created as DTensors laid out like their
parameter. Outside ``step()`` nothing changes: parameters, gradients and optimizer states
are DTensors, so ``state_dict()``, DCP checkpoints, ``clip_grad_norm_`` and LR schedulers
see what they saw before. The local view (lists, the local-keyed state dict) is built once
and kept between steps while the optimizer's groups and state dict stay the same objects;
a step then pays an identity check and a gradient move per parameter. Other optimizers
(and FSDP2's or the user's own DTensors) are untouched.

On CPU, PyTorch's default (``foreach=None``) is the per-parameter Python loop. Where the
user left that choice open, a CPU group whose tensors are all at most
``FOREACH_MAX_NUMEL`` elements, and at most ``FOREACH_MAX_GROUP_NUMEL`` together, steps
with the foreach implementation instead, for the classes whose foreach and per-parameter
updates are bit for bit the same on CPU (``FOREACH_IDENTICAL``; NAdam and RAdam round
differently and keep the loop). Measured on one core: Adam over BERT-tiny's 41 small
tensors 2.0 -> 1.2 ms; but over 4 M-element tensors it is slower (75 -> 107 ms: the
foreach temporaries of all tensors are alive at once), hence the first bound. Each foreach
op sweeps every tensor of the group, the loop one tensor's few blocks at a time, so once
the group outgrows the caches the loop wins too (CPU time of one step, one thread, this
2-core VM under load: 41 tensors, 0.40 M elements: loop 2.32 ms, foreach 1.98; 64
Linear layers 64 <-> 256, 129 tensors, 1.06 M: 5.93 vs 7.51; 16 x 131 K: 5.43 vs 9.51;
32 x 64 K: 5.84 vs 10.67), hence the second. ``foreach`` is None again after the step, so
``state_dict()`` is unchanged.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from torchalpa.core.optimizer_step import FOREACH_MAX_GROUP_NUMEL, FOREACH_MAX_NUMEL, steps_foreach

__all__ = ["lean_optimizer_steps", "ELEMENTWISE_OPTIMIZERS", "FOREACH_IDENTICAL",
           "FOREACH_MAX_NUMEL", "FOREACH_MAX_GROUP_NUMEL"]

# update of each element depends only on that element's parameter, gradient and state
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                          torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adamax,
                          torch.optim.NAdam, torch.optim.RAdam)

# foreach update == per-parameter update, bit for bit, on CPU (tests/test_lean_optim.py)
FOREACH_IDENTICAL = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                     torch.optim.RMSprop, torch.optim.Adamax)
_FOREACH_SET = "_torchalpa_foreach_set"   # on a param group whose foreach this module set

# set on each marked parameter: an attribute, not a weak reference, since a weakly
# referenced tensor cannot be swapped (Module.to() swaps DTensor parameters' contents)
_MARK = "_torchalpa_local_step"
_SWAPPED = "_torchalpa_local_swap"     # on an optimizer while its step runs on local tensors
_VIEW = "_torchalpa_local_view"        # on an optimizer: its _LocalView, kept between steps
_installed = False


def lean_optimizer_steps(params: Iterable[torch.Tensor]) -> None:
    """Let elementwise optimizers over ``params`` (DTensors) step on their local shards."""
    global _installed
    for p in params:
        if isinstance(p, DTensor):
            setattr(p, _MARK, True)
    if not _installed:
        register_optimizer_step_pre_hook(_to_local)
        register_optimizer_step_post_hook(_to_dtensor)
        _installed = True


def _is_ours(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and getattr(p, _MARK, False)


def _applies(opt: torch.optim.Optimizer) -> bool:
    if not isinstance(opt, ELEMENTWISE_OPTIMIZERS) or opt.defaults.get("differentiable"):
        return False
    params = [p for g in opt.param_groups for p in g["params"]]
    return bool(params) and all(_is_ours(p) for p in params)


class _LocalView:
    """An optimizer's parameters, groups and states as local tensors, kept between steps.

    Building it costs a dict and a DTensor lookup per parameter and state; a step that
    finds it still matching the optimizer (same state dict, same group lists) only checks
    identities, moves the gradients and swaps whole lists and the state dict."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.dtensor_state = opt.state
        self.local_state: defaultdict = defaultdict(dict)
        self.groups = []     # (the group's DTensor list, its local list, its length)
        self.pairs = []      # (DTensor parameter, its local tensor)
        for group in opt.param_groups:
            params = group["params"]
            locals_ = [p._local_tensor for p in params]
            self.pairs.extend(zip(params, locals_))
            self.groups.append((params, locals_, len(params)))

    def matches(self, opt: torch.optim.Optimizer) -> bool:
        """Whether the optimizer still has this view's state dict and group lists, and each
        parameter still its local tensor (``Module.to()`` swaps contents)."""
        return (opt.state is self.dtensor_state and len(opt.param_groups) == len(self.groups)
                and all(g["params"] is params and len(params) == n
                        for g, (params, _, n) in zip(opt.param_groups, self.groups))
                and all(p._local_tensor is local for p, local in self.pairs))

    def states_in(self) -> None:
        """Local states for the step: each DTensor state's local tensor (rebuilt where the
        user or a load replaced an entry since the last step)."""
        dstate, lstate = self.dtensor_state, self.local_state
        for p, local in self.pairs:
            ds = dstate.get(p)
            if not ds:
                lstate.pop(local, None)
                continue
            ls = lstate.get(local)
            if ls is None or len(ls) != len(ds):
                lstate[local] = ls = {}
            for k, v in ds.items():
                want = v._local_tensor if isinstance(v, DTensor) else v
                if ls.get(k) is not want:
                    ls[k] = want

    def states_out(self) -> None:
        """DTensor states after the step: in-place updates are already there; states the
        step created or replaced are wrapped like their parameter."""
        dstate, lstate = self.dtensor_state, self.local_state
        for p, local in self.pairs:
            ls = lstate.get(local)
            if not ls:
                continue
            ds = dstate.get(p)
            if ds is None:
                dstate[p] = ds = {}
            for k, v in ls.items():
                before = ds.get(k)
                if before is v or (isinstance(before, DTensor) and before._local_tensor is v):
                    continue
                if isinstance(v, torch.Tensor) and v.shape == local.shape and v.dim() > 0:
                    ds[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                               shape=p.shape, stride=p.stride())
                else:
                    ds[k] = v                           # scalars (the step count)


def _to_local(opt: torch.optim.Optimizer, args, kwargs) -> None:
    """Pre-step: local tensors (gradients and states too) in place of the DTensors."""
    if getattr(opt, _SWAPPED, None) is not None:       # a step that raised left them local
        _to_dtensor(opt, args, kwargs)
    view = getattr(opt, _VIEW, None)
    if view is None or not view.matches(opt):
        if not _applies(opt):
            setattr(opt, _VIEW, None)
            return
        view = _LocalView(opt)
        setattr(opt, _VIEW, view)
    view.states_in()
    for p, local in view.pairs:
        grad = p.grad
        local.grad = None if grad is None else (
            grad._local_tensor if isinstance(grad, DTensor) else grad)
    for group, (_, locals_, _) in zip(opt.param_groups, view.groups):
        group["params"] = locals_
        if _foreach_pays(opt, group):
            group["foreach"] = True
            group[_FOREACH_SET] = True
    opt.state = view.local_state
    setattr(opt, _SWAPPED, view)


def _foreach_pays(opt: torch.optim.Optimizer, group: dict) -> bool:
    """Whether ``group`` (its local tensors in place) steps faster, and identically, with
    the foreach implementation than with the CPU default the user left it at."""
    if not isinstance(opt, FOREACH_IDENTICAL) or "foreach" not in group \
            or group["foreach"] is not None or group.get("fused"):
        return False
    params = group["params"]
    # the bounds are the memory model's too (``core/optimizer_step.py``)
    return bool(params) and all(p.device.type == "cpu" for p in params) \
        and steps_foreach([p.numel() for p in params], "cpu")


def _to_dtensor(opt: torch.optim.Optimizer, args, kwargs) -> None:
    """Post-step: the DTensors back; states the step created become DTensors."""
    view = getattr(opt, _SWAPPED, None)
    if view is None:
        return
    setattr(opt, _SWAPPED, None)
    opt.state = view.dtensor_state
    for group, (params, _, _) in zip(opt.param_groups, view.groups):
        group["params"] = params
        if group.pop(_FOREACH_SET, False):
            group["foreach"] = None
    for _, local in view.pairs:
        local.grad = None
    view.states_out()
