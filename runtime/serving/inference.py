"""Forward-only programs: predictions, and losses in eval mode.

``pmodel.predict(*inputs)`` and an eval-mode ``pmodel(*batch)`` run a step with no
backward, and possibly a different graph than training's (dropout off, other batch
shapes). Each is captured on its own (``capture_forward``, given by the orchestration:
the frontend's tracer, op vocabulary and provenance, without the backward),
planned with every parameter and buffer pinned to the training plan's layout -- so the
DTensors the optimizer holds are used as they are -- and lowered with the same
``lower()``. The result (the loss, or the model's outputs) is planned whole on every
rank. Programs are cached per mode and input shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from torchalpa.core.calls import CallSignature
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.plan import Plan

__all__ = ["ForwardProgram", "ForwardPrograms", "pins_of"]


def pins_of(plan: Plan) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Pins (exact-name regexes) that hold every parameter and buffer to its training layout."""
    import re

    from torchalpa.core.placement import format_placements
    return tuple((re.escape(v.name), tuple(format_placements(v.placements)))
                 for v in plan.parameters)


@dataclass
class ForwardProgram:
    """A lowered forward step and how to call it."""

    program: fx.GraphModule
    state_names: list[str]
    unflatten: Callable[[torch.Tensor], object]
    plan: Plan
    buffer_updates: list[str] = field(default_factory=list)   # after the result, in order


@dataclass
class ForwardPrograms:
    """Forward-only programs of one ParallelModule, made on first use per (kind, mode,
    input shapes).

    ``capture_forward(module, examples, loss_fn, outputs=, signature=)`` captures a forward
    step (the frontend's ``capture_forward``); ``plan_forward(graph)`` plans a forward
    graph on the training mesh with the training
    layouts pinned (every rank gets the same plan); ``lower_forward(gm, plan, updates)``
    lowers it, returning ``(result, *new values of the buffers named in updates, ...)``:
    a train-mode forward (batch-norm statistics) writes its buffers as training does.
    """

    module: torch.nn.Module
    loss_fn: Callable | None
    training_plan: Plan
    plan_forward: Callable[[OpGraph], Plan]
    lower_forward: Callable[[fx.GraphModule, Plan, list[str]], fx.GraphModule]
    capture_forward: Callable[..., Any]
    signature: CallSignature | None = None
    _cache: dict[tuple, ForwardProgram] = field(default_factory=dict, repr=False)

    def get(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]], *, outputs: bool,
            training: bool, keywords: tuple[str, ...] = ()) -> ForwardProgram:
        """The program for global input ``specs`` (shape, dtype) in the given mode;
        ``keywords``: predict's tensors were given by these names."""
        key = (outputs, training, tuple((tuple(s), d) for s, d in specs), tuple(keywords))
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._make(specs, outputs, tuple(keywords))
        return found

    def _make(self, specs, outputs: bool, keywords: tuple[str, ...]) -> ForwardProgram:
        examples = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in specs]
        signature = self.signature
        if outputs and keywords:
            static = self.signature.static if self.signature is not None else ()
            signature = CallSignature(0, keywords, static)
        elif outputs:
            signature = None
        captured = self.capture_forward(self.module, examples, self.loss_fn, outputs=outputs,
                                   signature=signature)
        plan = self.plan_forward(captured.graph)
        expected = {v.name: v.placements for v in self.training_plan.parameters}
        moved = [v.name for v in plan.parameters
                 if v.name in expected and v.placements != expected[v.name]]
        assert not moved, f"forward plan moved pinned parameters: {moved}"
        program = self.lower_forward(captured.gm, plan, captured.buffer_updates)
        return ForwardProgram(program=program, state_names=captured.state_names,
                              unflatten=captured.unflatten, plan=plan,
                              buffer_updates=captured.buffer_updates)
