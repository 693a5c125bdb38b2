"""PipelineModule: the user's model run as a pipeline of stages across the ranks.

Each rank holds only its stage's parameters, as DTensors on its stage's submesh (the
other stages' parameters are DTensors on meshes it is not part of: no local data, no
gradient, skipped by the optimizer). A step splits the global batch into micro-batches
and runs the stage's programs through the plan's schedule.

Calling the module runs the whole step, forward and backward (a pipeline interleaves
them; 1F1B cannot wait for ``loss.backward()``), and returns the loss on every rank;
``loss.backward()`` then hands each parameter its gradient (times the loss's gradient),
so the usual ``loss = pmodel(x, y); loss.backward(); opt.step()`` loop works. Under
``torch.no_grad()`` only the forward work runs.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchalpa.plan import PipelinePlan
from torchalpa.runtime.pipeline import PipelineRunner, StageProgram
from torchalpa.runtime.step import split_micro_batches
from torchalpa.runtime.step_module import StepModule
from torchalpa.schedules import SCHEDULES

__all__ = ["PipelineModule"]


class _Step(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module: "PipelineModule", inputs, *params):
        loss, grads = module._run(inputs, backward=True)
        ctx.grads = grads
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        unit = grad_loss is None or (grad_loss.device.type == "cpu" and grad_loss.item() == 1.0)
        grads = [g if unit or g is None else g * grad_loss for g in ctx.grads]
        return (None, None, *grads)


class PipelineModule(StepModule):
    """A model parallelized as torchalpa pipeline stages."""

    plan: PipelinePlan

    def __init__(self, module: nn.Module, plan: PipelinePlan, program: StageProgram,
                 runner: PipelineRunner, stage_mesh, *, input_specs, device,
                 optimizer: Callable | None = None):
        super().__init__(module, plan, stage_mesh, device=device)
        self.stage = runner.stage
        self._program = program
        self._runner = runner
        self._input_specs = list(input_specs)
        self._last_stage_rank = plan.stages[-1].ranks[0]
        self._make_optimizer(optimizer)

    def local_program(self) -> str:
        return f"# stage {self.stage} of {len(self.plan.stages)}\n" + self._program.code()

    def _locals(self) -> list[torch.Tensor]:
        out = []
        for name in self._program.params:
            out.append(self.module.get_parameter(name))
        for name in self._program.buffers:
            try:
                t = self.module.get_buffer(name)
            except AttributeError:
                t = self.module.get_parameter(name)
            out.append(t)
        return [t.to_local() if isinstance(t, DTensor) else t for t in out]

    def _micro_batches(self, inputs: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        if len(inputs) != len(self._input_specs):
            raise TypeError(f"expected {len(self._input_specs)} inputs (model inputs, then "
                            f"targets), got {len(inputs)}")
        for i, (x, (shape, dtype)) in enumerate(zip(inputs, self._input_specs)):
            if tuple(x.shape) != tuple(shape) or x.dtype != dtype:
                raise ValueError(f"input {i} is {tuple(x.shape)} {x.dtype}, but the pipeline "
                                 f"was planned for {tuple(shape)} {dtype}; call auto_parallel "
                                 "again with example inputs of the new shape")
        return split_micro_batches([x.to(self._device) for x in inputs],
                                   self.plan.num_micro_batches)

    def _run(self, inputs, backward: bool):
        """One step: (loss on every rank, this stage's gradients or None)."""
        B, S = self.plan.num_micro_batches, len(self.plan.stages)
        actions = SCHEDULES[self.plan.schedule](S, B)[self.stage]
        if not backward:
            actions = [a for a in actions if a[0] == "F"]
        state = self._locals()
        saved: dict = {}
        grads = [None] * sum(self._program.grad_present)
        losses, updates = [], []
        self._runner.run(actions, state, self._micro_batches(inputs), saved, grads, losses,
                         updates)
        self._write_buffer_updates(updates)
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=self._device)
        loss = loss.detach().clone()
        dist.broadcast(loss, src=self._last_stage_rank)
        if not backward:
            return loss, None
        # a step's loss is the mean of the micro-batches': gradients scale by 1/B
        reduced = iter(self._program.reduce_grads(*[g / B for g in grads]))
        full = [next(reduced) if present else None for present in self._program.grad_present]
        return loss, full

    def _write_buffer_updates(self, updates: list[torch.Tensor]) -> None:
        n = len(self._program.buffer_updates)
        if not n or not updates:
            return
        # the last micro-batch's running statistics
        self._store_buffer_updates(self._program.buffer_updates, updates[-n:])

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Run the pipelined step and return the loss (mean over micro-batches)."""
        if not torch.is_grad_enabled():
            return self._run(inputs, backward=False)[0]
        params = [self.module.get_parameter(n) for n in self._program.params]
        locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        return _Step.apply(self, inputs, *locals_)

    def train_step(self, *inputs: torch.Tensor) -> torch.Tensor:
        optimizer = self._require_optimizer()
        optimizer.zero_grad(set_to_none=True)
        loss = self(*inputs)
        loss.backward()
        optimizer.step()
        return loss.detach()
