"""ParallelModule: the user's model, its parameters as DTensors, its step as a local program.

Parameters are swapped in place for DTensors with the planned placements (as FSDP2's
``fully_shard`` does), so ``pmodel.parameters()`` feeds any ``torch.optim`` optimizer and
its states are sharded like the parameters. Calling the module runs this rank's local
forward program; ``loss.backward()`` runs the local backward program, which leaves each
gradient in its parameter's layout.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from torchalpa import placement as P
from torchalpa.plan import Plan
from torchalpa.runtime.lower import LocalProgram

__all__ = ["ParallelModule", "to_dtensor_placements", "distribute_module_state"]


def to_dtensor_placements(placements) -> tuple:
    out = []
    for p in placements:
        if isinstance(p, P.Shard):
            out.append(Shard(p.dim))
        elif isinstance(p, P.Replicate):
            out.append(Replicate())
        else:
            out.append(Partial(p.reduce_op))
    return tuple(out)


def distribute_module_state(module: nn.Module, plan: Plan, mesh) -> None:
    """Replace every parameter and buffer named in the plan by a DTensor, in place.

    Values come from rank 0 (like DDP's initial broadcast), so all ranks start equal.
    Tied parameters stay tied: every module attribute holding one gets the same DTensor.
    """
    placements = {v.name: to_dtensor_placements(v.placements) for v in plan.parameters}
    named_params = dict(module.named_parameters())
    named_buffers = dict(module.named_buffers())
    new_by_id: dict[int, torch.Tensor] = {}
    for name, place in placements.items():
        old = named_params.get(name, named_buffers.get(name))
        if old is None:
            raise ValueError(f"the plan names {name!r}, which the model does not have; was the "
                             "plan made for another model?")
        if old.device.type == "meta":
            raise ValueError(f"{name} is on the meta device; auto_parallel needs real weights "
                             "(use torchalpa.plan(...) to plan without them)")
        dt = distribute_tensor(old.detach(), mesh, place, src_data_rank=0)
        new_by_id[id(old)] = nn.Parameter(dt, requires_grad=old.requires_grad) \
            if isinstance(old, nn.Parameter) else dt
    for mod in module.modules():
        for key, p in list(mod._parameters.items()):
            if p is not None and id(p) in new_by_id:
                mod._parameters[key] = new_by_id[id(p)]
        for key, b in list(mod._buffers.items()):
            if b is not None and id(b) in new_by_id:
                mod._buffers[key] = new_by_id[id(b)]


class _TrainingStep(torch.autograd.Function):
    """Forward program now, backward program on ``loss.backward()``."""

    @staticmethod
    def forward(ctx, program: LocalProgram, num_params: int, *args):
        outputs = program.forward(*args)
        loss, saved = outputs[0], outputs[1:]
        ctx.program = program
        ctx.num_params = num_params
        ctx.num_others = len(args) - num_params
        ctx.save_for_backward(*saved)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grads = list(ctx.program.backward(*ctx.saved_tensors))
        # The program seeds backward with d(loss) = 1; gradients are linear in that seed.
        unit = grad_loss is None or (grad_loss.device.type == "cpu" and grad_loss.item() == 1.0)
        if not unit:
            grads = [None if g is None else g * grad_loss for g in grads]
        return (None, None, *grads, *([None] * ctx.num_others))


class ParallelModule(nn.Module):
    """A model parallelized by torchalpa: call it like the single-device model."""

    def __init__(self, module: nn.Module, plan: Plan, program: LocalProgram, mesh, *,
                 param_names: list[str], buffer_names: list[str],
                 input_specs: list[tuple[tuple[int, ...], torch.dtype]], inputs: str,
                 device: torch.device,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None):
        super().__init__()
        self.module = module
        self.plan = plan
        self.mesh = mesh
        self._program = program
        self._param_names = list(param_names)
        self._buffer_names = list(buffer_names)
        self._input_specs = list(input_specs)
        self._inputs = inputs
        self._device = device
        self.optimizer = optimizer(self.parameters()) if optimizer is not None else None

    def _state(self) -> list[torch.Tensor]:
        tensors = [self.module.get_parameter(n) for n in self._param_names]
        tensors += [self._get_buffer_or_param(n) for n in self._buffer_names]
        return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]

    def _get_buffer_or_param(self, name: str) -> torch.Tensor:
        try:
            return self.module.get_buffer(name)
        except AttributeError:
            return self.module.get_parameter(name)

    def _check_inputs(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        expected = ", ".join(f"{tuple(s)} {str(d).removeprefix('torch.')}"
                             for s, d in self._input_specs)
        if len(inputs) != len(self._input_specs):
            raise TypeError(f"expected {len(self._input_specs)} inputs (model inputs, then loss "
                            f"targets) shaped [{expected}], got {len(inputs)}")
        out = []
        for i, (x, (shape, dtype)) in enumerate(zip(inputs, self._input_specs)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {i} must be a tensor, got {type(x).__name__}")
            if tuple(x.shape) != tuple(shape) or x.dtype != dtype:
                kind = "global batch" if self._inputs == "global" else "local shard"
                raise ValueError(
                    f"input {i} is {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}, but the "
                    f"plan was made for a {kind} of {tuple(shape)} "
                    f"{str(dtype).removeprefix('torch.')} (all inputs: [{expected}]); call "
                    "auto_parallel again with example inputs of the new shape")
            out.append(x.to(self._device, non_blocking=True))
        return out

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The loss of one step on the given batch (every rank returns the same value)."""
        args = self._state() + self._check_inputs(inputs)
        return _TrainingStep.apply(self._program, len(self._param_names), *args)

    def train_step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """zero_grad, forward, backward and optimizer step; returns the loss."""
        if self.optimizer is None:
            raise ValueError(
                "train_step needs an optimizer: pass auto_parallel(..., optimizer=lambda ps: "
                "torch.optim.Adam(ps, lr=1e-3)) or set pmodel.optimizer = "
                "torch.optim.Adam(pmodel.parameters())")
        self.optimizer.zero_grad(set_to_none=True)
        loss = self(*inputs)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def local_program(self) -> str:
        """This rank's forward and backward programs as Python code."""
        return self._program.code()

    def extra_repr(self) -> str:
        return f"mesh={tuple(self.plan.mesh_shape)}, plan={self.plan.graph_fingerprint}"
