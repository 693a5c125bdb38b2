"""StepModule: what every torchalpa module shares, whichever method built it.

``ParallelModule`` (``runtime/module.py``) is the one module class of every method (an
intra-op plan is a one-stage pipeline); this base holds what needs no runner: the user's
model (its parameters swapped for DTensors), the plan, this rank's mesh, the optimizer
over the parallel parameters, and writing the step's new buffer values (batch-norm
statistics) back into the buffers' local shards. Checkpoints, ``isinstance`` checks and
tools read this common surface.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["StepModule"]

NEEDS_OPTIMIZER = ("train_step needs an optimizer: pass auto_parallel(..., optimizer=lambda ps: "
                   "torch.optim.Adam(ps, lr=1e-3)) or set pmodel.optimizer = "
                   "torch.optim.Adam(pmodel.parameters())")


class StepModule(nn.Module):
    """A model parallelized by torchalpa: ``module``, ``plan``, ``mesh``, ``optimizer``."""

    def __init__(self, module: nn.Module, plan, mesh, *, device: torch.device):
        super().__init__()
        self.module = module
        self.plan = plan
        self.mesh = mesh
        self._device = device
        self.optimizer: torch.optim.Optimizer | None = None

    def _make_optimizer(self, optimizer: Callable[..., torch.optim.Optimizer] | None) -> None:
        """``optimizer(parameters)``, the parallel parameters (DTensors), if one is given."""
        self.optimizer = optimizer(self.parameters()) if optimizer is not None else None

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise ValueError(NEEDS_OPTIMIZER)
        return self.optimizer

    def _store_buffer_updates(self, names: Sequence[str], values: Sequence[torch.Tensor]
                              ) -> None:
        """Copy the step's new buffer ``values`` into the buffers ``names`` (their local
        shards when they are DTensors)."""
        with torch.no_grad():
            for name, value in zip(names, values):
                buf = self.module.get_buffer(name)
                (buf.to_local() if isinstance(buf, DTensor) else buf).copy_(value)

    def profile(self, steps: int, path, *inputs: torch.Tensor, **kwargs: torch.Tensor) -> str:
        """Record ``steps`` training steps on the batch ``inputs`` (as ``train_step`` takes
        it) with ``torch.profiler`` and write this rank's Chrome trace to ``path`` (Perfetto),
        the plan's collectives labelled by kind, mesh axis and bytes; returns the file
        written (``runtime/timeline.py``). The steps are real: parameters change."""
        from torchalpa.runtime.timeline import profile_steps
        return profile_steps(self, steps, path, inputs, kwargs)
