"""Capture a PyTorch training step (model + loss, forward and backward) as an OpGraph.

The step is traced once with ``make_fx`` on fake tensors, so no real weight is read or
allocated: parameters, buffers and inputs only lend their shapes and dtypes. The trace is
the joint ATen graph ``(params, buffers, inputs) -> (loss, *grads)`` after PyTorch's core
ATen decompositions (plus ``addmm -> mm + add``, so a bias add can follow a partial matmul,
as in Alpa's HLO).

Each node keeps a link to the module the user wrote (``layers.3.mlp``): forward nodes via
module hooks, backward nodes via autograd's sequence numbers, the mechanism AOTAutograd
uses. The captured fx GraphModule is kept as the *source graph* the runtime lowers.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from torchalpa.opgraph import GraphOutputs, OpGraph, OpNode, Operand, TensorSpec, ValueRef

__all__ = ["Capture", "capture", "CaptureError", "split_inputs", "trace_ops"]

log = logging.getLogger("torchalpa.capture")
_MODULE_KEY = "torchalpa_module"


class CaptureError(RuntimeError):
    """The training step could not be traced; the message says where and what to do."""


@dataclass
class Capture:
    """The captured step: the OpGraph for passes, the fx graph for the runtime."""

    graph: OpGraph
    gm: fx.GraphModule
    param_names: list[str]          # trainable parameters, in placeholder order
    buffer_names: list[str]         # buffers and frozen parameters, in placeholder order
    input_names: list[str]          # one per example input (model inputs, then targets)
    seconds: float = 0.0


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


def _decompositions() -> dict:
    table = dict(core_aten_decompositions())

    def addmm(bias, a, b, *, beta=1, alpha=1):
        out = torch.mm(a, b)
        if alpha != 1:
            out = out * alpha
        if beta == 0:
            return out
        return out + (bias if beta == 1 else bias * beta)

    table[torch.ops.aten.addmm.default] = addmm
    return table


@contextlib.contextmanager
def _annotate_modules(model: torch.nn.Module):
    """Tag every traced node with the path of the innermost module that ran it."""
    open_scopes: list[contextlib.AbstractContextManager] = []
    handles = []

    def enter(path):
        def hook(module, args):
            scope = fx_traceback.annotate({_MODULE_KEY: path})
            scope.__enter__()
            open_scopes.append(scope)
        return hook

    def leave(module, args, output):
        open_scopes.pop().__exit__(None, None, None)

    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(path)))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while open_scopes:
            open_scopes.pop().__exit__(None, None, None)


def _copy_module_to_backward(gm: fx.GraphModule) -> None:
    """Give each backward node the module of the forward op it differentiates.

    Autograd tags both with the same sequence number (``seq_nr``); the first forward node
    of a sequence number is the op that created the autograd node.
    """
    first_forward: dict[int, fx.Node] = {}
    for n in gm.graph.nodes:
        if "seq_nr" in n.meta and not n.meta.get("autograd_backward"):
            first_forward.setdefault(n.meta["seq_nr"], n)
    for n in gm.graph.nodes:
        if n.meta.get("autograd_backward") and "seq_nr" in n.meta:
            fwd = first_forward.get(n.meta["seq_nr"])
            path = (fwd.meta.get("custom") or {}).get(_MODULE_KEY) if fwd is not None else None
            if path is not None:
                n.meta["custom"] = {**(n.meta.get("custom") or {}), _MODULE_KEY: path}


def _spec(val) -> TensorSpec:
    return TensorSpec(tuple(int(s) for s in val.shape), str(val.dtype).removeprefix("torch."))


def _freeze(value):
    """Lists -> tuples, dtypes/devices/layouts -> strings, so args are plain frozen data."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    return value


# Ops that only relabel or create memory: no arithmetic.
_NO_FLOPS = {"view", "_unsafe_view", "reshape", "permute", "t", "transpose", "expand", "alias",
             "detach", "unsqueeze", "squeeze", "slice", "select", "clone", "full", "full_like",
             "zeros", "zeros_like", "ones", "ones_like", "empty", "empty_like", "scalar_tensor",
             "new_zeros", "new_ones", "new_empty", "new_full", "cat", "split", "stack",
             "_to_copy", "copy", "lift_fresh_copy", "arange", "as_strided"}


def _flops(node: fx.Node) -> float:
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None and packet.__name__ in _NO_FLOPS:
        return 0.0
    out = node.meta.get("val")
    if packet in flop_registry:
        args, kwargs = tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a,
                                (node.args, node.kwargs))
        try:
            return float(flop_registry[packet](*args, **kwargs, out_val=out))
        except Exception:  # a formula that can't read these args: fall back to numel
            pass
    vals = out if isinstance(out, (list, tuple)) else [out]
    return float(sum(v.numel() for v in vals if isinstance(v, torch.Tensor)))


def _phases(gm: fx.GraphModule, loss_node: fx.Node) -> set[str]:
    """Names of forward nodes: everything the loss depends on."""
    forward, stack = set(), [loss_node]
    while stack:
        n = stack.pop()
        if n.name in forward:
            continue
        forward.add(n.name)
        stack.extend(n.all_input_nodes)
    return forward


def _to_opgraph(gm: fx.GraphModule, kinds: list[tuple[str, str]]) -> OpGraph:
    """fx joint graph -> OpGraph. ``kinds`` gives (kind, target) for each placeholder."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kind_of = {ph.name: kt for ph, kt in zip(placeholders, kinds)}
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    loss_node = outs[0]
    forward = _phases(gm, loss_node)
    refs: dict[str, ValueRef] = {}
    by_name: dict[str, OpNode] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            kind, target = kind_of[n.name]
            node = OpNode(name=n.name, op=kind, kind=kind, outputs=(_spec(n.meta["val"]),),
                          source=n.name, target=target, is_param=(kind == "param"))
        elif n.op == "call_function" and n.target is operator.getitem:
            producer, index = n.args
            refs[n.name] = ValueRef(refs[producer.name].node, index)
            continue
        elif n.op == "call_function":
            node = _op_node(n, refs, by_name, "forward" if n.name in forward else "backward")
        else:
            continue
        by_name[n.name] = node
        refs[n.name] = ValueRef(n.name)
    param_placeholders = [ph for ph in placeholders if kind_of[ph.name][0] == "param"]
    grads = tuple((kind_of[ph.name][1], refs[g.name])
                  for ph, g in zip(param_placeholders, outs[1:]) if g is not None)
    grad_nodes = {ref.node for _, ref in grads}
    nodes = [replace(x, is_grad=True) if x.name in grad_nodes and x.kind == "op" else x
             for x in by_name.values()]
    return OpGraph(nodes, GraphOutputs(loss=refs[loss_node.name], grads=grads))


def _op_node(n: fx.Node, refs: dict[str, ValueRef], by_name: dict[str, OpNode],
             phase: str) -> OpNode:
    operands: list[ValueRef] = []

    def mark(a):
        if isinstance(a, fx.Node):
            operands.append(refs[a.name])
            return Operand(len(operands) - 1)
        return _freeze(a)

    args = _freeze(tree_map(mark, list(n.args)))
    kwargs = tuple(sorted((k, _freeze(tree_map(mark, v))) for k, v in n.kwargs.items()))
    val = n.meta.get("val")
    vals = list(val) if isinstance(val, (list, tuple)) else [val]
    outputs = tuple(_spec(v) for v in vals if isinstance(v, torch.Tensor))
    if not outputs:
        raise CaptureError(f"op {n.target} ({n.name}) produced no tensor; "
                           "torchalpa captures tensor programs only")
    in_bytes = sum(by_name[r.node].outputs[r.index].nbytes for r in operands)
    custom = n.meta.get("custom") or {}
    return OpNode(
        name=n.name, op=str(n.target), kind="op", operands=tuple(operands), args=args,
        kwargs=kwargs, outputs=outputs, flops=_flops(n),
        bytes=float(in_bytes + sum(o.nbytes for o in outputs)),
        module=custom.get(_MODULE_KEY, ""), phase=phase, source=n.name)


def capture(model: torch.nn.Module, example_inputs: Sequence, loss_fn: Callable | None = None,
            ) -> Capture:
    """Trace ``loss_fn(model(*inputs), *targets)`` and its backward into an OpGraph.

    Runs on fake tensors: real weights are never read, so ``model`` may live on ``meta``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inputs, targets = split_inputs(example_inputs, loss_fn)
    for i, x in enumerate(tuple(inputs) + tuple(targets)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"example_inputs[{i}] must be a tensor, got {type(x).__name__}")

    named = list(model.named_parameters())
    trainable = [(k, p) for k, p in named if p.requires_grad]
    frozen = [(k, p) for k, p in named if not p.requires_grad] + list(model.named_buffers())
    if not trainable:
        raise ValueError("the model has no trainable parameters (none with requires_grad=True)")
    param_names = [k for k, _ in trainable]
    buffer_names = [k for k, _ in frozen]
    num_inputs = len(inputs)

    def joint(params, buffers, *batch):
        state = {**dict(zip(param_names, params)), **dict(zip(buffer_names, buffers))}
        out = functional_call(model, state, tuple(batch[:num_inputs]), strict=False)
        loss = loss_fn(out, *batch[num_inputs:]) if loss_fn is not None else out
        if isinstance(loss, (tuple, list)) and len(loss) > 0:
            loss = loss[0]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else \
                f"a tensor of shape {tuple(loss.shape)}"
            raise CaptureError(
                f"the training step must produce a scalar loss, got {what}; pass loss_fn= or "
                "make forward return the loss")
        from torch._functorch._aot_autograd.logging_utils import \
            setup_stacktrace_preservation_hooks
        setup_stacktrace_preservation_hooks([loss.grad_fn])
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return [loss, *grads]

    params = [p.detach().requires_grad_(True) for _, p in trainable]
    buffers = [b.detach() for _, b in frozen]
    start = time.perf_counter()
    try:
        with fx_traceback.preserve_node_meta(), _annotate_modules(model):
            gm = make_fx(joint, tracing_mode="fake", decomposition_table=_decompositions(),
                         _allow_non_fake_inputs=True)(params, buffers, *inputs, *targets)
    except CaptureError:
        raise
    except Exception as e:  # data-dependent control flow, unsupported Python, ...
        raise CaptureError(_explain_trace_failure(e)) from e
    _copy_module_to_backward(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    kinds = ([("param", k) for k in param_names] + [("buffer", k) for k in buffer_names]
             + [("input", f"input{i}") for i in range(len(inputs) + len(targets))])
    graph = _to_opgraph(gm, kinds)
    graph.check()
    seconds = time.perf_counter() - start
    log.info("captured %s in %.2fs", graph.summary(), seconds)
    return Capture(graph=graph, gm=gm, param_names=param_names, buffer_names=buffer_names,
                   input_names=[f"input{i}" for i in range(len(inputs) + len(targets))],
                   seconds=seconds)


def _explain_trace_failure(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}"
    hint = ""
    if "data-dependent" in text or "GuardOnDataDependentSymNode" in text or "item()" in text:
        hint = ("the model's control flow depends on tensor values (e.g. `if x.sum() > 0`, "
                "`.item()`, `.tolist()`); torchalpa captures one static graph. Rewrite it with "
                "torch.where / masking, or move the branch out of forward.")
    return ("could not trace the training step: " + text.splitlines()[0][:500]
            + (f"\nhint: {hint}" if hint else ""))


def trace_ops(fn: Callable, example_args: Sequence[torch.Tensor]
              ) -> tuple[fx.GraphModule, dict[str, OpNode]]:
    """Trace a plain tensor function (no backward) and describe each op as an OpNode.

    For tools and tests that look at single ops (the rule harness); leaves are inputs.
    """
    gm = make_fx(fn, tracing_mode="fake", decomposition_table=_decompositions())(*example_args)
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
