"""Capture a PyTorch training step (model + loss, forward and backward) as an OpGraph.

The step is traced once with ``make_fx`` on fake tensors, so no real weight is read or
allocated: parameters, buffers and inputs only lend their shapes and dtypes. The trace is
the joint ATen graph ``(params, buffers, inputs) -> (loss, *grads, *new buffer values)``
in the op vocabulary of ``frontends/opset.py`` (core ATen, with attention, norms' and
softmax's backward, dropout and batch norm kept as single ops).

- Tied weights (one ``nn.Parameter`` reachable under two names) are one parameter with
  one gradient, the sum over its uses; frozen parameters (``requires_grad=False``) are
  inputs like buffers, with no gradient.
- Buffers the forward writes (batch-norm running statistics, ``num_batches_tracked``)
  stay functional: their new values are extra graph outputs, listed in
  ``GraphOutputs.buffer_updates`` / ``Capture.buffer_updates``.
- Dropout is ``aten.native_dropout``, the only random op (``opset.RANDOM_OPS``).
- A model whose forward returns a HuggingFace ``ModelOutput`` or a dict: ``loss_fn`` gets
  that object; without ``loss_fn`` its ``"loss"`` entry is the loss.
- Tensors forward builds from Python values (``torch.tensor(2.0)``, a KV cache's empty
  tensors) become ops (``frontends/constants.py``); backward runs with the traced state
  in place, so activation checkpointing recomputes in backward where the planner sees it
  (reentrant checkpointing is traced through ``loss.backward()``); RNNs are traced
  without oneDNN-only kernels (``opset.device_neutral_kernels``).
- ``example_inputs`` may be a dict of keyword arguments (``torchalpa/core/calls.py``).
- Every node knows the module path (``layers.3.mlp``) and the "file:line" of the user
  code that made it (``OpNode.module`` / ``OpNode.stack``), forward and backward alike;
  ``graph.meta["repeated_blocks"]`` tags the ops of identical repeated layers.

The captured fx GraphModule is kept as the *source graph* the runtime lowers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import operator
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.graph import _PyTreeCodeGen
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_map, tree_structure, tree_unflatten

from torchalpa.core.calls import CallSignature, positional_binding, record_output_type
from torchalpa.core.opgraph import (
    ABSENT_DTYPE,
    GraphOutputs,
    Operand,
    OpGraph,
    OpNode,
    TensorSpec,
    ValueRef,
)
from torchalpa.frontends.constants import LargeConstant, inline_constants
from torchalpa.frontends.functionalize import (
    NeedsFunctionalization,
    functionalize,
    is_view_op,
    retrace_functional,
)
from torchalpa.frontends.joint_graph import ancestor_names
from torchalpa.frontends.merged_batch import lift_merged_batch_products
from torchalpa.frontends.naming import argument_names
from torchalpa.frontends.op_record import RecordedOp, record_ops
from torchalpa.frontends.opset import (
    FusedCalls,
    decompositions,
    device_neutral_kernels,
    flop_count,
    flop_formula,
    routed_matmul,
)
from torchalpa.frontends.piece_views import split_piece_views
from torchalpa.frontends.provenance import (
    Provenance,
    copy_forward_tags_to_backward,
    line_of,
    module_of,
    tracing_backward,
)
from torchalpa.frontends.repeated import find_repeated_blocks
from torchalpa.frontends.restride import reshape_plain_restrides

__all__ = ["Capture", "capture", "record_step", "CaptureError", "split_inputs", "trace_ops",
           "ForwardCapture", "capture_forward", "unchanged_ops"]

log = logging.getLogger("torchalpa.capture")


class CaptureError(RuntimeError):
    """The training step could not be traced; the message says where and what to do."""


@dataclass
class Capture:
    """The captured step: the OpGraph for passes, the fx graph for the runtime.

    The fx graph returns ``(loss, *grads, *buffer_updates)``: one gradient per name in
    ``param_names`` (None if unused), then the new value of each buffer named in
    ``buffer_updates``.
    """

    graph: OpGraph
    gm: fx.GraphModule
    param_names: list[str]          # trainable parameters, in placeholder order
    buffer_names: list[str]         # buffers and frozen parameters, in placeholder order
    input_names: list[str]          # one per example input (model inputs, then targets)
    seconds: float = 0.0
    buffer_updates: list[str] = field(default_factory=list)   # buffers forward writes
    signature: CallSignature | None = None  # how the model was called (positional, keywords)


def split_inputs(example_inputs: Sequence, loss_fn: Callable | None) -> tuple[tuple, tuple]:
    """Split ``example_inputs`` into (model inputs, loss targets).

    With a ``loss_fn(outputs, *targets)``, the inputs end with the targets: as many as
    ``loss_fn`` takes positional arguments after the outputs (one if that can't be read).
    """
    example_inputs = tuple(example_inputs)
    if loss_fn is None:
        return example_inputs, ()
    num_targets = 1
    try:
        params = list(inspect.signature(loss_fn).parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                      and p.default is p.empty]
        if not any(p.kind == p.VAR_POSITIONAL for p in params) and positional:
            num_targets = len(positional) - 1
    except (TypeError, ValueError):
        pass
    if num_targets >= len(example_inputs):
        raise ValueError(
            f"loss_fn takes {num_targets} target(s) but example_inputs has only "
            f"{len(example_inputs)} item(s); pass (model inputs..., targets...)")
    cut = len(example_inputs) - num_targets
    return example_inputs[:cut], example_inputs[cut:]


def _loss_of(out, binding: str = "") -> torch.Tensor:
    """The scalar loss in what ``loss_fn`` (or forward) returned.

    ``binding``: how positional example inputs bound to forward's parameters, shown when
    no loss came back (labels given by position often land in another parameter)."""
    if isinstance(out, Mapping) and "loss" in out:
        out = out["loss"]
    elif dataclasses.is_dataclass(out) and isinstance(loss := getattr(out, "loss", None),
                                                      torch.Tensor):
        out = loss
    elif isinstance(out, (tuple, list)) and len(out) > 0:
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        what = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) \
            else type(out).__name__
        bound = (f"\nThe example inputs were bound by position: {binding}; to pass labels "
                 "(HuggingFace models), give example_inputs as a dict of keyword arguments, "
                 "e.g. {'input_ids': ids, 'labels': ids}.") if binding else ""
        raise CaptureError(
            f"the training step must produce a scalar loss, got {what}; pass loss_fn= or "
            "make forward return the loss (a tensor, the first item of a tuple, or the "
            f"'loss' entry of a dict / ModelOutput / dataclass){bound}")
    return out


def _batch(example_inputs: Sequence, loss_fn: Callable | None, signature: CallSignature, *,
           with_targets: bool) -> tuple[tuple, tuple]:
    """(model inputs, loss targets) of a step's example inputs: keyword calls and forward
    steps (``with_targets=False``) have no targets. A TypeError names anything that is
    not a tensor, or a ``loss_fn`` that is not callable."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function loss_fn(outputs, *targets) returning the "
                        f"scalar loss (e.g. torch.nn.functional.mse_loss), or None when "
                        f"forward returns the loss; got {type(loss_fn).__name__} {loss_fn!r}")
    if signature.by_keyword or not with_targets:
        inputs, targets = tuple(example_inputs), ()
    else:
        inputs, targets = split_inputs(example_inputs, loss_fn)
    for i, x in enumerate(inputs + targets):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"example_inputs[{i}] must be a tensor, got {type(x).__name__}")
        if x.dim() and x.shape[0] == 0:
            raise ValueError(f"example_inputs[{i}] has an empty batch (shape "
                             f"{tuple(x.shape)}): give at least one example, the batch the "
                             "step is planned for")
    return inputs, targets


@contextlib.contextmanager
def _fake_kernel_failures_unlogged():
    """Torch logs a fake kernel's refusal as an ERROR with its traceback before raising it;
    the ``CaptureError`` says it in the user's terms (with the original as its cause), so
    the log is held back while tracing, unless torchalpa logs at DEBUG."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    if logging.getLogger("torchalpa").isEnabledFor(logging.DEBUG):
        yield
        return
    before = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_log.setLevel(before)


def _trace(fn: Callable, args: tuple, provenance: Provenance, num_inputs: int) -> fx.GraphModule:
    """``fn(*args)`` traced on fake tensors in the capture's op vocabulary, each op tagged
    with its provenance; a failure becomes a ``CaptureError`` saying what in the user's
    code stopped the trace (the original error is its ``__cause__``)."""
    try:
        # the graph module's Python code is made when first read or run (``.code``, a
        # call), not after each pass that edits the graph (four times 0.3 s at 32 layers)
        with provenance.tracing(), device_neutral_kernels(), _use_lazy_graph_module(True), \
                _fake_kernel_failures_unlogged():
            return make_fx(fn, tracing_mode="fake", decomposition_table=decompositions(),
                           _allow_non_fake_inputs=True)(*args)
    except CaptureError:
        raise
    except Exception as e:  # data-dependent control flow, unsupported Python, ...
        raise CaptureError(_explain_trace_failure(e, provenance, num_inputs)) from e


def _named_state(model: torch.nn.Module) -> tuple[list, list]:
    """(name, tensor) of the trainable parameters, and of the frozen ones and the buffers
    (a tied parameter appears once)."""
    named = list(model.named_parameters())
    trainable = [(k, p) for k, p in named if p.requires_grad]
    frozen = [(k, p) for k, p in named if not p.requires_grad] + list(model.named_buffers())
    if not trainable:
        raise ValueError("the model has no trainable parameters (none with requires_grad=True)")
    return trainable, frozen


def _trace_joint(make_joint: Callable[[bool], Callable], trainable: list, frozen: list,
                 batch: tuple, provenance: Provenance, num_inputs: int) -> fx.GraphModule:
    """Trace the joint step; a model whose backward must be traced through its forward
    (``torch.utils.checkpoint(use_reentrant=True)``) is traced again that way."""
    through_backward = False
    while True:
        params = [p.detach().requires_grad_(True) for _, p in trainable]
        buffers = [b.detach() for _, b in frozen]
        try:
            return _trace(make_joint(through_backward), (params, buffers, *batch), provenance,
                          num_inputs)
        except CaptureError as e:
            cause = e.__cause__
            if not through_backward and isinstance(cause, Exception) and _needs_backward(cause):
                through_backward = True
                continue
            raise


def capture(model: torch.nn.Module, example_inputs: Sequence | Mapping,
            loss_fn: Callable | None = None, *, rematerialize_parameters: bool = False,
            signature: CallSignature | None = None) -> Capture:
    """Trace ``loss_fn(model(*inputs), *targets)`` and its backward into an OpGraph.

    Runs on fake tensors: real weights are never read, so ``model`` may live on ``meta``.
    ``example_inputs`` may be a dict of keyword arguments (``torchalpa/core/calls.py``): then
    the model is called ``model(**example_inputs)`` and the loss is its own (or
    ``loss_fn(outputs)``). ``signature``: the call's shape when ``example_inputs`` is the
    already flattened tensor list of ``CallSignature.of``.
    ``rematerialize_parameters``: backward reads parameters through its own views
    (``frontends/param_remat.py``: ZeRO-3 gathers them again instead of keeping forward's).
    Activation checkpointing rewrites a capture: ``frontends/block_remat.py``.
    """
    joint = _joint_step(model, example_inputs, loss_fn, signature, capture.__code__)
    param_names, buffer_names = joint.param_names, joint.buffer_names
    start = time.perf_counter()
    gm = _trace_joint(joint.make, joint.trainable, joint.frozen, joint.batch,
                      joint.provenance, joint.num_inputs)
    traced = time.perf_counter()
    kinds = ([("param", k) for k in param_names] + [("buffer", k) for k in buffer_names]
             + [("input", name) for name in joint.input_names])
    gm, updates = _functional(gm, kinds, joint.provenance)
    if rematerialize_parameters:
        from torchalpa.frontends.param_remat import rematerialize_parameter_views
        rematerialize_parameter_views(gm, len(param_names))
    graph = _opgraph(gm, kinds, [k for k in buffer_names if k in updates])
    graph.check()
    seconds = time.perf_counter() - start
    log.info("captured %s in %.2fs (trace %.2fs)", graph.summary(), seconds, traced - start)
    return Capture(graph=graph, gm=gm, param_names=param_names, buffer_names=buffer_names,
                   input_names=joint.input_names, seconds=seconds,
                   buffer_updates=[k for k, _ in graph.outputs.buffer_updates],
                   signature=joint.signature)


def record_step(model: torch.nn.Module, example_inputs: Sequence | Mapping,
                loss_fn: Callable | None = None, *, signature: CallSignature | None = None
                ) -> list[RecordedOp]:
    """The ops ``capture`` would trace for this step, run on ``meta`` copies of the
    parameters, buffers and inputs instead of traced (``frontends/op_record.py``): the same
    joint function under the same modes and decompositions, at a tenth of a trace's cost.
    Raises what the run raises (a step ``capture`` traces through its backward is one)."""
    joint = _joint_step(model, example_inputs, loss_fn, signature, record_step.__code__)

    def on_meta(t: torch.Tensor, grad: bool = False) -> torch.Tensor:
        return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype,
                                   device="meta").requires_grad_(grad)
    params = [on_meta(p, True) for _, p in joint.trainable]
    buffers = [on_meta(b) for _, b in joint.frozen]
    batch = [on_meta(x) if isinstance(x, torch.Tensor) else x for x in joint.batch]
    with joint.provenance.tracing(), device_neutral_kernels():
        return record_ops(joint.make(False), (params, buffers, *batch), decompositions())


@dataclass
class _Joint:
    """The joint step ``capture`` traces, and what it needs around it."""

    make: Callable[[bool], Callable]   # through_backward -> (params, buffers, *batch) -> outs
    trainable: list
    frozen: list
    batch: tuple
    provenance: Provenance
    num_inputs: int
    param_names: list[str]
    buffer_names: list[str]
    input_names: list[str]
    signature: CallSignature


def _joint_step(model: torch.nn.Module, example_inputs: Sequence | Mapping,
                loss_fn: Callable | None, signature: CallSignature | None, caller) -> _Joint:
    """``capture``'s joint function of ``model`` and ``loss_fn`` on ``example_inputs``;
    ``caller``: the code object whose frame ends the search for the user's line."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if signature is None:
        signature, example_inputs = CallSignature.of(example_inputs)
    assert not isinstance(example_inputs, Mapping), "keyword inputs are flattened above"
    inputs, targets = _batch(example_inputs, loss_fn, signature, with_targets=True)

    _check_devices(model, tuple(inputs) + tuple(targets))
    trainable, frozen = _named_state(model)
    param_names = [k for k, _ in trainable]
    buffer_names = [k for k, _ in frozen]
    num_inputs = len(inputs)
    input_names = argument_names(model, loss_fn, len(inputs), len(targets))
    num_positional = len(inputs) - len(signature.keywords)   # keywords name themselves
    input_names[num_positional:len(inputs)] = list(signature.keywords)
    binding = "" if signature.by_keyword or loss_fn is not None else \
        positional_binding(model, num_inputs)

    def make_joint(through_backward: bool):
        def joint(params, buffers, *batch):
            state = {**dict(zip(param_names, params)), **dict(zip(buffer_names, buffers))}
            # backward runs with the traced state in place too: activation checkpointing
            # recomputes forward there, and must read the traced parameters, not the real ones
            with _reparametrize_module(model, state, tie_weights=True):
                out = signature.call(model, batch[:num_inputs])
                if loss_fn is None:
                    record_output_type(signature, out)
                provenance.in_loss = True
                loss = _loss_of(loss_fn(out, *batch[num_inputs:]) if loss_fn is not None
                                else out, binding)
                provenance.in_loss = False
                if loss.grad_fn is not None:     # tags backward (seq_nr)
                    setup_stacktrace_preservation_hooks([loss.grad_fn])
                with tracing_backward():
                    grads = _gradients(loss, params, through_backward)
            return [loss, *grads, *buffers]
        return joint

    provenance = Provenance(model, stop=[make_joint(False).__code__, _loss_of.__code__,
                                         caller])
    return _Joint(make_joint, trainable, frozen, (*inputs, *targets), provenance, num_inputs,
                  param_names, buffer_names, input_names, signature)


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
                    signature: CallSignature | None = None) -> ForwardCapture:
    """Trace ``model(*inputs)`` (``outputs=True``) or its loss (``outputs=False``: the inputs
    end with the targets, as for training) without backward: predictions and eval-mode
    losses (``runtime/serving/inference.py``), with the tracer, op vocabulary and provenance of
    ``capture``.

    The model's outputs are returned as one tensor: itself if the model returns one
    tensor, else its tensors flattened and concatenated (they must share a dtype);
    ``unflatten`` rebuilds the returned structure. ``signature``: how the model is called
    (``torchalpa/core/calls.py``; keyword inputs carry no loss targets).
    """
    if signature is None:
        signature = CallSignature(len(example_inputs) if outputs else 0)
    inputs, targets = _batch(example_inputs, loss_fn, signature, with_targets=not outputs)
    named = list(model.named_parameters()) + list(model.named_buffers())
    names = [k for k, _ in named]
    num_inputs = len(inputs)
    structure: dict = {}

    def step(state, *batch):
        with _reparametrize_module(model, dict(zip(names, state)), tie_weights=True):
            out = signature.call(model, batch[:num_inputs])
        provenance.in_loss = True
        if outputs:
            result = _flatten_outputs(out, structure)
        else:
            result = _loss_of(loss_fn(out, *batch[num_inputs:]) if loss_fn is not None else out)
        provenance.in_loss = False
        return [result, *state]

    # stand-ins of the global shapes: the module may already hold DTensors
    state = [torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for _, t in named]
    provenance = Provenance(model, stop=[step.__code__, capture_forward.__code__])
    start = time.perf_counter()
    with torch.no_grad():
        gm = _trace(step, (state, *inputs, *targets), provenance, num_inputs)
    kinds = [("buffer", k) for k in names] + \
        [("input", f"input{i}") for i in range(len(inputs) + len(targets))]
    gm, updates = _functional(gm, kinds, provenance)
    updated = [k for k in names if k in updates]
    # read-only state like buffers, but the model's parameters: layout options that speak
    # of parameters (AutoShardingOption.allow_replicated_parameters) apply to them
    graph = _opgraph(gm, kinds, updated,
                     weights=frozenset(k for k, _ in model.named_parameters()))
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


def _functional(gm: fx.GraphModule, kinds: list[tuple[str, str]], provenance: Provenance
                ) -> tuple[fx.GraphModule, set[str]]:
    """A traced step made ready for the passes: constants inlined, checked for
    data-dependent shapes, backward tagged like its forward, buffer writes turned into
    outputs, aliases dropped, a dim viewed as pieces and cut written as a split
    (``frontends/piece_views.py``), a ``bmm`` over merged batch dims as one over them
    (``frontends/merged_batch.py``); returns it with ``_make_functional``'s buffer updates."""
    _inline_constants(gm, provenance)
    _check_static(gm, provenance)
    copy_forward_tags_to_backward(gm)
    gm, updates = _make_functional(gm, kinds, provenance)
    _drop_aliases(gm)
    reshape_plain_restrides(gm)
    split_piece_views(gm)
    lift_merged_batch_products(gm)
    return gm, updates


def _opgraph(gm: fx.GraphModule, kinds: list[tuple[str, str]], updated: list[str],
             weights: frozenset[str] = frozenset()) -> OpGraph:
    """The OpGraph of a functional step (dead code removed), its repeated blocks tagged."""
    gm.graph.eliminate_dead_code()
    gm.recompile()
    graph = to_opgraph(gm, kinds, updated, weights)
    graph.meta["repeated_blocks"] = find_repeated_blocks(graph)
    return graph


def _needs_backward(e: Exception) -> bool:
    """What torch.autograd.grad raises when forward used reentrant checkpointing."""
    return "checkpoint" in str(e).lower() and ".grad()" in str(e)


def _gradients(loss: torch.Tensor, params: list[torch.Tensor], through_backward: bool):
    """d loss / d params (None where unused).

    ``through_backward``: by ``loss.backward()`` into the leaves' ``.grad``, which reentrant
    checkpointing (``use_reentrant=True``) needs, as it runs its own backward inside.
    """
    if not through_backward:
        return torch.autograd.grad(loss, params, allow_unused=True)
    loss.backward()
    return [p.grad for p in params]


def _inline_constants(gm: fx.GraphModule, provenance: Provenance) -> None:
    """Tensors forward made from Python values become ops (``frontends/constants.py``)."""
    try:
        inline_constants(gm)
    except LargeConstant as e:
        raise CaptureError(
            f"could not capture the training step {_where(e.node, provenance)}: forward builds "
            f"a constant tensor of {e.numel} elements from Python values (torch.tensor(...) "
            "or a tensor made outside the traced inputs).\nhint: register it once as a buffer "
            "(self.register_buffer(name, tensor, persistent=False)) and read it in forward, "
            "so it is planned and kept on device.") from None


def _check_devices(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> None:
    """The model and the batch must live on one device (``meta`` for planning)."""
    devices: dict[str, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        devices.setdefault(t.device.type, f"parameter/buffer {name!r}")
    for i, t in enumerate(batch):
        devices.setdefault(t.device.type, f"example_inputs[{i}]")
    if len(devices) > 1:
        found = ", ".join(f"{what} on {device}" for device, what in devices.items())
        raise ValueError(f"the model and example_inputs must be on one device, found {found}; "
                         "build both under the same `with torch.device(...)` (meta to plan "
                         "without memory)")
    if "cuda" in devices and not torch.backends.cuda.is_built():
        # autograd would abort the process asking for a CUDA device guard
        raise ValueError(f"{devices['cuda']} is a (fake) CUDA tensor, but this PyTorch build "
                         "has no CUDA: build the model and inputs on the meta device to "
                         "capture and plan for GPUs here")


def _where(node: fx.Node, provenance: Provenance) -> str:
    """"in module 'layers.3.mlp' (MLP) at model.py:42" for error messages."""
    line = line_of(node)
    return f"in {provenance.describe_module(module_of(node))}" + (f" at {line}" if line else "")


def _make_functional(gm: fx.GraphModule, kinds: list[tuple[str, str]],
                     provenance: Provenance) -> tuple[fx.GraphModule, set[str]]:
    """In-place ops -> functional; the output's buffer slots get the written buffers' values.

    The joint returned every buffer after the grads; a buffer nobody wrote is dropped
    from the output again, so the output is ``(loss, *grads, *updated buffers)``. Returns
    the graph module (a new one if writes into views needed a re-trace) and the FQNs of
    the buffers written.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    leaf_kind = {ph.name: kt for ph, kt in zip(placeholders, kinds)}

    def fail(node: fx.Node, why: str) -> CaptureError:
        return CaptureError(f"could not capture the in-place op {node.target} "
                            f"{_where(node, provenance)}: {why}")

    gm.graph.eliminate_dead_code()              # views made only for autograd's bookkeeping
    try:
        updates = functionalize(gm, leaf_kind, fail)
    except NeedsFunctionalization:               # a write into a view: the thorough way
        signature = gm.graph._codegen
        gm = retrace_functional(gm)
        gm.graph._codegen = signature            # still called as (params, buffers, *batch)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        leaf_kind = {ph.name: kt for ph, kt in zip(placeholders, kinds)}
        try:
            updates = functionalize(gm, leaf_kind, fail)
        except NeedsFunctionalization as e:
            raise fail(e.node, f"it writes storage that {e.alias.name} reads afterwards; "
                               "compute a new tensor instead (torch.where, torch.cat, "
                               "index_put, scatter)") from None
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    buffer_fqns = [fqn for kind, fqn in kinds if kind == "buffer"]
    num_head = len(outs) - len(buffer_fqns)
    kept = [updates[fqn] for fqn in buffer_fqns if fqn in updates]
    output.args = (outs[:num_head] + kept,)
    codegen = gm.graph._codegen
    if isinstance(codegen, _PyTreeCodeGen):   # the callable returns a list as long
        codegen.pytree_info = codegen.pytree_info._replace(
            out_spec=tree_structure([None] * (num_head + len(kept))))
    gm.recompile()
    return gm, set(updates)


def _check_static(gm: fx.GraphModule, provenance: Provenance) -> None:
    """Refuse values the trace could only follow symbolically: Python numbers read out of
    tensors, and tensors whose shape depends on tensor values."""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        val = n.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else (val,)
        where = _where(n, provenance)
        if any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) for v in vals):
            raise CaptureError(
                f"could not capture the training step {where}: it reads a tensor's value into "
                f"Python ({n.target}: `.item()`, `.tolist()`, `int(t)`, `float(t)`); torchalpa "
                "captures one static graph.\nhint: keep the value a tensor (a 0-d tensor "
                "broadcasts in arithmetic), or compute it outside forward and pass it in.")
        if any(isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape)
               for v in vals):
            raise CaptureError(
                f"could not capture the training step {where}: the shape of {n.target}'s "
                "result depends on tensor values (nonzero, masked_select, unique, boolean-mask "
                "indexing `x[mask]`).\nhint: keep shapes static, e.g. torch.where(mask, x, 0) "
                "or a fixed-size topk.")


def _drop_aliases(gm: fx.GraphModule) -> None:
    """``aten.alias`` (autograd's saved outputs) is the identity on values: remove it."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.alias.default:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)


def _explain_trace_failure(e: Exception, provenance: Provenance, num_inputs: int) -> str:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    path, line, text = provenance.where(e)
    message = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    if _in_traceback(e, "_detect_is_causal_mask"):
        hint = ("nn.Transformer* compares the attention mask's values with a causal mask "
                "(torch.equal) to decide whether it is causal; pass is_causal=True with a "
                "causal mask (or is_causal=False) so nothing reads mask values.")
    elif isinstance(e, (DataDependentOutputException, GuardOnDataDependentSymNode)) \
            or "data-dependent" in message or "item()" in message:
        hint = ("the model's control flow depends on tensor values (e.g. `if x.sum() > 0`, "
                "`.item()`, `.tolist()`); torchalpa captures one static graph. Rewrite it with "
                "torch.where / masking, or move the branch out of forward.")
    elif (op := _refusing_meta_kernel(e)) is not None:
        hint = (f"the fake (meta) kernel of {op}, which tracing runs instead of the real "
                "kernel, refused these inputs; the real kernel may accept them (fake kernels "
                "can be stricter, e.g. about dtypes). Give the op inputs its fake kernel "
                "accepts (cast them), call an equivalent op, or register a decomposition "
                "for it in frontends/opset.py; this is not a problem of the model's Python.")
    elif isinstance(e, DynamicOutputShapeException):
        hint = ("an op's output shape depends on tensor values (nonzero, masked_select, "
                "unique, boolean-mask indexing `x[mask]`); keep shapes static, e.g. "
                "torch.where(mask, x, 0) or a fixed-size top-k instead.")
    elif isinstance(e, (AttributeError, TypeError)):
        try:
            signature = str(inspect.signature(provenance.model.forward))
        except (TypeError, ValueError):
            signature = "(...)"
        hint = (f"check that the first {num_inputs} example input(s) match "
                f"{type(provenance.model).__name__}.forward{signature[:200]} in order (the "
                "rest go to loss_fn), and that forward only does tensor work on them.")
    else:
        hint = ("only tensor code that runs the same way on fake tensors (no real values, "
                "no .numpy(), no data-dependent Python) can be captured; rewrite that line "
                "with torch ops, or move it out of forward.")
    where = provenance.describe_module(path)
    at = f" at {line}" + (f": `{text}`" if text else "") if line else ""
    return (f"could not trace the training step in {where}{at}\n  {message}\nhint: {hint}")


def _in_traceback(e: Exception, function: str) -> bool:
    """Whether ``function`` is on the stack where ``e`` was raised."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False


_META_KERNEL_FILES = ("_meta_registrations.py", "fake_impls.py")


def _refusing_meta_kernel(e: Exception) -> str | None:
    """The op whose fake/meta kernel raised ``e``, if that is where it came from."""
    tb, in_meta, op = e.__traceback__, False, None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        in_meta = in_meta or filename.endswith(_META_KERNEL_FILES) or \
            (os.sep + "_refs" + os.sep) in filename
        func = tb.tb_frame.f_locals.get("func")
        if isinstance(func, torch._ops.OpOverload):
            op = func                                # the innermost dispatched op
        tb = tb.tb_next
    if not in_meta:
        return None
    return str(op) if op is not None else "an ATen op"


_ABSENT = TensorSpec((), ABSENT_DTYPE)    # a None output: outputs stay positional


def _spec(val) -> TensorSpec:
    return TensorSpec(tuple(int(s) for s in val.shape), str(val.dtype).removeprefix("torch."))


def _freeze(value):
    """Lists -> tuples, dtypes/devices/layouts -> strings, so args are plain frozen data."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    return value



def to_opgraph(gm: fx.GraphModule, kinds: list[tuple[str, str]],
                updated_buffers: Sequence[str] = (), weights: frozenset[str] = frozenset(),
                known: Mapping[str, OpNode] | None = None) -> OpGraph:
    """fx joint graph -> OpGraph. ``kinds`` gives (kind, target) for each placeholder.

    The graph returns (loss, *grads, *new values of ``updated_buffers``); the forward
    phase is what the loss and the buffer updates depend on. ``weights``: targets of
    buffer placeholders that are the model's parameters (a forward-only step reads them as
    state, with no gradient): their nodes have ``is_param`` set. ``known``: op nodes
    already described (the same op on values of the same shapes, ``frontends/rebatch.py``).
    """
    known = known or {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kind_of = {ph.name: kt for ph, kt in zip(placeholders, kinds)}
    outs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    num_params = sum(1 for kind, _ in kinds if kind == "param")
    loss_node, grad_outs = outs[0], outs[1:1 + num_params]
    update_outs = outs[1 + num_params:]
    forward = ancestor_names([loss_node, *update_outs])
    refs: dict[str, ValueRef] = {}
    by_name: dict[str, OpNode] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            kind, target = kind_of[n.name]
            node = OpNode(name=n.name, op=kind, kind=kind, outputs=(_spec(n.meta["val"]),),
                          source=n.name, target=target,
                          is_param=kind == "param" or target in weights)
        elif n.op == "call_function" and n.target is operator.getitem:
            producer, index = n.args
            refs[n.name] = ValueRef(refs[producer.name].node, index)
            continue
        elif n.op == "call_function":
            phase = "forward" if n.name in forward else "backward"
            node = known.get(n.name)
            if node is None or node.phase != phase:
                node = _op_node(n, refs, by_name, phase)
            elif node.is_grad:
                node = replace(node, is_grad=False)
        else:
            continue
        by_name[n.name] = node
        refs[n.name] = ValueRef(n.name)
    param_names = [target for kind, target in kinds if kind == "param"]
    grads = tuple((fqn, refs[g.name]) for fqn, g in zip(param_names, grad_outs) if g is not None)
    buffer_updates = tuple((fqn, refs[u.name]) for fqn, u in zip(updated_buffers, update_outs))
    grad_nodes = {ref.node for _, ref in grads}
    nodes = [replace(x, is_grad=True) if x.name in grad_nodes and x.kind == "op" else x
             for x in by_name.values()]
    return OpGraph(nodes, GraphOutputs(loss=refs[loss_node.name], grads=grads,
                                       buffer_updates=buffer_updates))


def unchanged_ops(old: fx.Graph, graph: OpGraph, new: fx.Graph) -> dict[str, OpNode]:
    """The OpNodes of ``graph`` (made from ``old``) that describe op nodes of ``new``, a
    rewritten copy of ``old`` (``frontends/block_remat.py``), as well: the same name,
    target, value (the same object), module and line, the same constant arguments, and
    every input a value of the same name as before (the same object; a getitem of the same
    index of a producer of the same name). For ``to_opgraph(known=)``: describing an op is
    most of making an OpGraph, and a rewrite changes few ops."""
    by_name = {n.name: n for n in old.nodes}
    same: set[str] = set()                    # nodes whose reference and value are as before
    known: dict[str, OpNode] = {}
    for n in new.nodes:
        o = by_name.get(n.name)
        if o is None or o.op != n.op or o.target != n.target \
                or n.meta.get("val") is not o.meta.get("val"):
            continue
        if n.op == "placeholder":
            same.add(n.name)
        elif n.op != "call_function":
            continue
        elif n.target is operator.getitem:
            if _same_args(n.args, o.args, same):
                same.add(n.name)
        else:
            same.add(n.name)                  # referred to by its name; its value is as before
            if (n.name in graph and module_of(n) == module_of(o) and line_of(n) == line_of(o)
                    and _same_args((n.args, n.kwargs), (o.args, o.kwargs), same)):
                known[n.name] = graph.node(n.name)
    return known


def _same_args(a, b, same: set[str]) -> bool:
    """Whether two nodes' arguments are alike: nodes of one name whose values are as
    before (in ``same``), containers of alike items, constants equal and of one type."""
    if isinstance(a, fx.Node):
        return isinstance(b, fx.Node) and a.name == b.name and a.name in same
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_args(x, y, same) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_args(a[k], b[k], same) for k in a)
    if isinstance(a, torch.Tensor):
        return a is b
    return bool(a == b)


def _frozen(arg: Any, mark: Callable[[Any], Any]) -> Any:
    """``_freeze(tree_map(mark, arg))`` without pytree's per-leaf bookkeeping (a third of
    building an OpGraph): nodes marked, lists and tuples as tuples; a dict or a named
    tuple (no ATen op takes one) the general way."""
    if isinstance(arg, fx.Node):
        return mark(arg)
    if isinstance(arg, (list, tuple)) and not hasattr(arg, "_fields"):
        return tuple(_frozen(a, mark) for a in arg)
    if isinstance(arg, (dict, tuple)):
        return _freeze(tree_map(mark, arg))
    return _freeze(arg)


def _fake_values(arg: Any) -> Any:
    """``arg`` with each node replaced by its fake value (``meta["val"]``)."""
    if isinstance(arg, fx.Node):
        return arg.meta.get("val")
    if type(arg) is tuple:
        return tuple(_fake_values(a) for a in arg)
    if isinstance(arg, list):
        return [_fake_values(a) for a in arg]
    if isinstance(arg, dict) or isinstance(arg, tuple):
        return tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, arg)
    return arg


def _op_node(n: fx.Node, refs: dict[str, ValueRef], by_name: dict[str, OpNode],
             phase: str) -> OpNode:
    operands: list[ValueRef] = []

    def mark(a):
        if isinstance(a, fx.Node):
            operands.append(refs[a.name])
            return Operand(len(operands) - 1)
        return _freeze(a)

    args = _frozen(n.args, mark)
    assert isinstance(args, tuple), "a tuple of arguments freezes to a tuple"
    kwargs = tuple(sorted((k, _frozen(v, mark)) for k, v in n.kwargs.items()))
    val = n.meta.get("val")
    vals = list(val) if isinstance(val, (list, tuple)) else [val]
    outputs = tuple(_spec(v) if isinstance(v, torch.Tensor) else _ABSENT for v in vals)
    if all(o.is_absent for o in outputs):
        raise CaptureError(f"op {n.target} ({n.name}) in module '{module_of(n)}' at "
                           f"{line_of(n) or '?'} produced no tensor; torchalpa captures "
                           "tensor programs only")
    # a view reads and writes nothing: it is free on the roofline and owns no memory
    aliases = is_view_op(n.target)
    in_bytes = sum(by_name[r.node].outputs[r.index].nbytes for r in operands)
    # the fake values only where a flop formula reads them
    fake_args, fake_kwargs = _fake_values((n.args, n.kwargs)) \
        if flop_formula(n.target) is not None else ((), {})
    return OpNode(
        name=n.name, op=str(n.target), kind="op", operands=tuple(operands), args=args,
        kwargs=kwargs, outputs=outputs, flops=flop_count(n.target, fake_args, fake_kwargs, val),
        bytes=0.0 if aliases else float(in_bytes + sum(o.nbytes for o in outputs)),
        aliases=aliases, module=module_of(n), phase=phase, source=n.name, stack=line_of(n))


def trace_ops(fn: Callable, example_args: Sequence[torch.Tensor]
              ) -> tuple[fx.GraphModule, dict[str, OpNode]]:
    """Trace a plain tensor function (no backward) and describe each op as an OpNode.

    For tools and tests that look at single ops (the rule harness); leaves are inputs.
    Uses the same op vocabulary as ``capture``.
    """
    with FusedCalls(), routed_matmul():
        gm = make_fx(fn, tracing_mode="fake", decomposition_table=decompositions())(
            *example_args)
    refs: dict[str, ValueRef] = {}
    by_name: dict[str, OpNode] = {}
    for i, n in enumerate(gm.graph.nodes):
        if n.op == "placeholder":
            by_name[n.name] = OpNode(name=n.name, op="input", kind="input",
                                     outputs=(_spec(n.meta["val"]),), target=f"input{i}")
            refs[n.name] = ValueRef(n.name)
        elif n.op == "call_function" and n.target is operator.getitem:
            producer, index = n.args
            refs[n.name] = ValueRef(refs[producer.name].node, index)
        elif n.op == "call_function":
            by_name[n.name] = _op_node(n, refs, by_name, "forward")
            refs[n.name] = ValueRef(n.name)
    return gm, by_name
