"""Run one rank's local programs for a step, over one or several micro-batches.

A step on ``k`` micro-batches splits every input along dim 0 into ``k`` equal chunks
(the plan was made for one chunk), runs the forward and backward programs per chunk and
sums the gradients locally as the backward program leaves them; the plan's final
resharding of the gradients (``LocalProgram.reduce_grads``) then runs once for the whole
step. The loss is the mean of the micro-batch losses, and the gradients are those of that
mean: for a loss that averages over the batch (the usual ``reduction="mean"``) both equal
what one device computes on the whole batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from torchalpa.runtime.early_reduce import early_reduce_program
from torchalpa.runtime.lower import LocalProgram

__all__ = ["StepRunner", "split_micro_batches"]


def split_micro_batches(inputs: Sequence[torch.Tensor], num_micro_batches: int,
                        what: str = "input") -> list[list[torch.Tensor]]:
    """``k`` lists of inputs, each holding chunk ``i`` of every input's dim 0."""
    if num_micro_batches == 1:
        return [list(inputs)]
    for i, x in enumerate(inputs):
        if x.dim() == 0 or x.shape[0] % num_micro_batches:
            size = "no dim 0" if x.dim() == 0 else f"dim 0 of size {x.shape[0]}"
            raise ValueError(f"{what} {i} has {size}, which does not split into "
                             f"num_micro_batches={num_micro_batches} equal micro-batches; use "
                             "a batch size that divides, or another num_micro_batches")
    chunks = [torch.chunk(x, num_micro_batches, dim=0) for x in inputs]
    return [[c[m] for c in chunks] for m in range(num_micro_batches)]


class StepRunner:
    """Forward, backward and gradient reduction of one step, micro-batch by micro-batch."""

    def __init__(self, program: LocalProgram, num_micro_batches: int = 1):
        self.program = program
        self.num_micro_batches = num_micro_batches
        self.last_buffer_updates: list[torch.Tensor] = []   # of the step's last micro-batch
        # one micro-batch: backward and the gradients' collectives as one program, each
        # collective issued as soon as its gradients exist (runtime.early_reduce)
        self._backward_reduce = early_reduce_program(program.backward, program.reduce_grads,
                                                     num_micro_batches)

    def _forward(self, state, micro):
        """(loss, saved) of one micro-batch; its buffer updates are kept aside."""
        loss, *rest = self.program.forward(*state, *micro)
        n = len(self.program.buffer_updates)
        if n:
            self.last_buffer_updates, rest = rest[:n], rest[n:]
        return loss, rest

    def forward(self, state: list[torch.Tensor], inputs: Sequence[torch.Tensor]
                ) -> tuple[torch.Tensor, list[tuple]]:
        """Mean loss over the micro-batches and each micro-batch's saved values (all kept,
        as autograd keeps them until ``backward``)."""
        losses, saved = [], []
        for micro in split_micro_batches(inputs, self.num_micro_batches):
            loss, rest = self._forward(state, micro)
            losses.append(loss)
            saved.append(tuple(rest))
        return self._mean(losses), saved

    def loss(self, state: list[torch.Tensor], inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Forward only: the mean loss, keeping nothing for backward."""
        losses = [self._forward(state, micro)[0]
                  for micro in split_micro_batches(inputs, self.num_micro_batches)]
        return self._mean(losses)

    def backward(self, saved: list[tuple], scale: torch.Tensor | float | None = None
                 ) -> list[torch.Tensor | None]:
        """Gradients of ``scale * mean loss`` in their parameters' layouts (None: unused)."""
        if self._backward_reduce is not None and len(saved) == 1:
            return self._scale(self._backward_reduce(*saved[0]), scale)
        raw = None
        for values in saved:
            raw = self._accumulate(raw, self.program.backward(*values))
        return self._reduce(raw, scale)

    def run(self, state: list[torch.Tensor], inputs: Sequence[torch.Tensor]
            ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Forward and backward per micro-batch (one micro-batch's activations alive at a
        time), one gradient reduction: (mean loss, gradients in their layouts)."""
        losses, raw = [], None
        for micro in split_micro_batches(inputs, self.num_micro_batches):
            loss, saved = self._forward(state, micro)
            losses.append(loss)
            if self._backward_reduce is not None:
                return loss, self._scale(self._backward_reduce(*saved), None)
            grads = self.program.backward(*saved)
            del saved
            raw = self._accumulate(raw, grads)
        return self._mean(losses), self._reduce(raw, None)

    # -- helpers ------------------------------------------------------------------------
    def _mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if len(losses) == 1:
            return losses[0]
        return torch.stack(losses).mean()

    @staticmethod
    def _accumulate(total, grads):
        if total is None:
            return list(grads)
        # out of place: a raw gradient may alias a value the caller still holds
        return [g if t is None else t if g is None else t + g for t, g in zip(total, grads)]

    def _reduce(self, raw, scale) -> list[torch.Tensor | None]:
        """Apply the plan's gradient resharding once, then the 1/k and ``scale`` factors."""
        present = [g for g in raw if g is not None]
        reduced = iter(self.program.reduce_grads(*present))
        return self._scale([None if g is None else next(reduced) for g in raw], scale)

    def _scale(self, grads, scale) -> list[torch.Tensor | None]:
        """The 1/k and ``scale`` factors on reduced gradients."""
        factor = 1.0 / self.num_micro_batches
        out = []
        for g in grads:
            if g is None:
                out.append(None)
                continue
            if scale is not None:
                g = g * scale
            if factor != 1.0:
                g = g * factor
            out.append(g)
        return out
