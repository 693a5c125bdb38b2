"""Forward-only programs: predictions, and losses in eval mode.

``pmodel.predict(*inputs)`` and an eval-mode ``pmodel(*batch)`` run a step with no
backward, and possibly a different graph than training's (dropout off, other batch
shapes). Each is captured on its own (``capture_forward``: the same tracer, op vocabulary
and provenance as the training capture, without the backward), planned with every
parameter and buffer pinned to the training plan's layout -- so the DTensors the optimizer
holds are used as they are -- and lowered with the same ``lower()``. The result (the loss,
or the model's outputs) is planned whole on every rank. Programs are cached per mode and
input shapes.

The forward capture here reuses the frontend's building blocks; it belongs next to
``frontends.torch_export.capture`` once the frontend offers a forward-only capture.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchalpa.opgraph import OpGraph
from torchalpa.plan import Plan

__all__ = ["ForwardCapture", "capture_forward", "ForwardProgram", "ForwardPrograms"]


@dataclass
class ForwardCapture:
    """A captured forward step: ``(*state, *inputs) -> (result, *buffer updates)``."""

    graph: OpGraph
    gm: fx.GraphModule
    state_names: list[str]          # parameters (trainable or not), then buffers
    unflatten: Callable[[torch.Tensor], object]   # result -> what the step returned
    buffer_updates: list[str] = field(default_factory=list)   # buffers forward writes


def capture_forward(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor],
                    loss_fn: Callable | None = None, *, outputs: bool,
                    signature=None) -> ForwardCapture:
    """Trace ``model(*inputs)`` (``outputs=True``) or its loss (``outputs=False``: the inputs
    end with the targets, as for training) without backward.

    The model's outputs are returned as one tensor: itself if the model returns one
    tensor, else its tensors flattened and concatenated (they must share a dtype);
    ``unflatten`` rebuilds the returned structure. ``signature``: how the model is called
    (``frontends/calls.CallSignature``; keyword inputs carry no loss targets).
    """
    from torchalpa.frontends import torch_export as te
    from torchalpa.frontends.opset import decompositions, device_neutral_kernels
    from torchalpa.frontends.provenance import Provenance
    from torchalpa.frontends.repeated import find_repeated_blocks

    from torchalpa.calls import CallSignature
    if signature is None:
        signature = CallSignature(len(example_inputs) if outputs else 0)
    if outputs or signature.by_keyword:
        inputs, targets = tuple(example_inputs), ()
    else:
        inputs, targets = te.split_inputs(example_inputs, loss_fn)
    for i, x in enumerate(inputs + targets):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input {i} must be a tensor, got {type(x).__name__}")
    named = list(model.named_parameters()) + list(model.named_buffers())
    names = [k for k, _ in named]
    num_inputs = len(inputs)
    structure: dict = {}

    def step(state, *batch):
        out = functional_call(model, dict(zip(names, state)), tuple(batch[:num_inputs]),
                              strict=False) if not signature.by_keyword else \
            functional_call(model, dict(zip(names, state)), (),
                            {**dict(zip(signature.keywords, batch[:num_inputs])),
                             **dict(signature.static)}, strict=False)
        provenance.in_loss = True
        if outputs:
            result = _flatten_outputs(out, structure)
        else:
            result = te._loss_of(loss_fn(out, *batch[num_inputs:]) if loss_fn is not None
                                 else out)
        provenance.in_loss = False
        return [result, *state]

    # stand-ins of the global shapes: the module may already hold DTensors
    state = [torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for _, t in named]
    provenance = Provenance(model, stop=[step.__code__, capture_forward.__code__])
    start = time.perf_counter()
    try:
        with provenance.tracing(), torch.no_grad(), device_neutral_kernels():
            gm = make_fx(step, tracing_mode="fake", decomposition_table=decompositions(),
                         _allow_non_fake_inputs=True)(state, *inputs, *targets)
    except te.CaptureError:
        raise
    except Exception as e:
        raise te.CaptureError(te._explain_trace_failure(e, provenance, num_inputs)) from e
    te._inline_constants(gm, provenance)
    kinds = [("buffer", k) for k in names] + \
        [("input", f"input{i}") for i in range(len(inputs) + len(targets))]
    te._check_static(gm, provenance)
    gm, updates = te._make_functional(gm, kinds, provenance)
    te._drop_aliases(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    updated = [k for k in names if k in updates]
    graph = te._to_opgraph(gm, kinds, updated)
    graph.meta["repeated_blocks"] = find_repeated_blocks(graph)
    graph.meta["capture_seconds"] = time.perf_counter() - start
    return ForwardCapture(graph=graph, gm=gm, state_names=names,
                          unflatten=structure.get("unflatten", lambda t: t),
                          buffer_updates=updated)


def _flatten_outputs(out, structure: dict) -> torch.Tensor:
    """One tensor holding every tensor the model returned; records how to undo it."""
    if isinstance(out, torch.Tensor):
        return out
    leaves, spec = tree_flatten(out)
    tensors = [(i, x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if not tensors:
        raise TypeError(f"the model returned {type(out).__name__} with no tensor in it; "
                        "predict returns tensors")
    dtypes = {x.dtype for _, x in tensors}
    if len(dtypes) > 1:
        raise NotImplementedError(
            f"predict gathers the model's outputs as one tensor, but they have several dtypes "
            f"({', '.join(sorted(str(d) for d in dtypes))}); return tensors of one dtype")
    shapes = [(i, tuple(x.shape)) for i, x in tensors]

    def unflatten(flat: torch.Tensor):
        parts, offset = list(leaves), 0
        for i, shape in shapes:
            n = math.prod(shape)
            parts[i] = flat[offset:offset + n].view(shape)
            offset += n
        return tree_unflatten(parts, spec)

    structure["unflatten"] = unflatten
    return torch.cat([x.reshape(-1) for _, x in tensors])


def pins_of(plan: Plan) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Pins (exact-name regexes) that hold every parameter and buffer to its training layout."""
    import re
    from torchalpa.placement import format_placements
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


class ForwardPrograms:
    """Forward-only programs of one ParallelModule, made on first use per (kind, mode,
    input shapes).

    ``plan_forward(graph)`` plans a forward graph on the training mesh with the training
    layouts pinned (every rank gets the same plan); ``lower_forward(gm, plan, updates)``
    lowers it, returning ``(result, *new values of the buffers named in updates, ...)``:
    a train-mode forward (batch-norm statistics) writes its buffers as training does.
    """

    def __init__(self, module: torch.nn.Module, loss_fn: Callable | None, training_plan: Plan,
                 plan_forward: Callable[[OpGraph], Plan],
                 lower_forward: Callable[[fx.GraphModule, Plan, list[str]], fx.GraphModule],
                 signature=None):
        self.module = module
        self.loss_fn = loss_fn
        self.training_plan = training_plan
        self.plan_forward = plan_forward
        self.lower_forward = lower_forward
        self.signature = signature
        self._cache: dict[tuple, ForwardProgram] = {}

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
        from torchalpa.calls import CallSignature
        examples = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in specs]
        signature = self.signature
        if outputs and keywords:
            static = self.signature.static if self.signature is not None else ()
            signature = CallSignature(0, keywords, static)
        elif outputs:
            signature = None
        captured = capture_forward(self.module, examples, self.loss_fn, outputs=outputs,
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
