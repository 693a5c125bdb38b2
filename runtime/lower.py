"""Lower a Plan over the source graph to this rank's local program.

The source graph is the captured joint step ``(params, buffers, inputs) -> (loss, *grads)``
on global shapes. Lowering rewrites it for one rank: every op runs on local blocks, with
shape arguments localized (``runtime.localize``), and every resharding step the plan
lists becomes a call in ``runtime.collectives`` right before the op that needs it. The
result is split into three programs, so it can sit behind ``loss.backward()``:

- ``forward``: the loss and the values backward needs;
- ``backward``: those values -> each gradient as the last op left it (possibly a partial
  sum, or a layout other than its parameter's);
- ``reduce_grads``: the plan's final resharding of each gradient into its parameter's layout.

Every resharding step is linear, so gradients of several micro-batches can be summed
locally and reduced once (``reduce_grads`` runs once per optimizer step, not per
micro-batch), which is how gradient accumulation saves communication.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

import torchalpa.attention  # noqa: F401  (registers torchalpa::sdpa, which programs call)
from torchalpa.plan import Plan, ReshardStep
from torchalpa.runtime import collectives as C
from torchalpa.runtime.buckets import fuse_gradient_buckets, gradient_buckets
from torchalpa.runtime.localize import localize
from torchalpa.runtime.overlap import overlap_collectives

__all__ = ["LocalProgram", "lower", "OUTPUT"]

OUTPUT = "<output>"


@dataclass
class LocalProgram:
    """One rank's forward and backward programs and what they expect."""

    forward: fx.GraphModule       # (*params, *buffers, *inputs) -> (loss, *updates, *saved)
    backward: fx.GraphModule      # (*saved) -> one raw gradient per trainable parameter (or None)
    reduce_grads: fx.GraphModule  # (*raw gradients that are not None) -> gradients in layout
    buffer_updates: tuple = ()    # buffers whose new values forward returns after the loss

    def code(self) -> str:
        return ("# forward: (params, buffers, inputs) -> (loss, saved...)\n" + self.forward.code
                + "\n# backward: (saved...) -> raw grads\n" + self.backward.code
                + "\n# reduce_grads: (raw grads...) -> grads in their parameters' layouts\n"
                + self.reduce_grads.code)

    def compiled(self, **options) -> "LocalProgram":
        """The same programs under ``torch.compile(**options)`` (compiled on first call)."""
        return _CompiledProgram(
            forward=torch.compile(self.forward, **options),
            backward=torch.compile(self.backward, **options),
            reduce_grads=torch.compile(self.reduce_grads, **options), source=self)


@dataclass
class _CompiledProgram(LocalProgram):
    """Compiled programs; ``code()`` prints the source programs they were compiled from."""

    source: LocalProgram | None = None

    def code(self) -> str:
        return "# compiled with torch.compile from:\n" + self.source.code()


class _Emitter:
    """Appends the collective calls of plan steps to a graph."""

    def __init__(self, graph: fx.Graph, mesh_shape, coords, group_names):
        self.graph, self.mesh_shape = graph, tuple(mesh_shape)
        self.coords, self.group_names = tuple(coords), tuple(group_names)

    def steps(self, value: fx.Node, steps: tuple[ReshardStep, ...]) -> fx.Node:
        for step in steps:
            value = self.step(value, step)
        return value

    def step(self, value: fx.Node, step: ReshardStep) -> fx.Node:
        n, group = self.mesh_shape[step.axis], self.group_names[step.axis]
        call = self.graph.call_function
        if step.kind == "all_reduce":
            return call(C.all_reduce, (value, step.reduce_op, group))
        if step.kind == "all_gather":
            return call(C.all_gather, (value, step.dim, n, group))
        if step.kind == "reduce_scatter":
            return call(C.reduce_scatter, (value, step.dim, step.reduce_op, n, group))
        if step.kind == "all_to_all":
            return call(C.all_to_all, (value, step.src_dim, step.dim, n, group))
        if step.kind == "slice":
            return call(C.local_chunk, (value, step.dim, n, self.coords[step.axis]))
        if step.kind == "partition":
            return call(C.local_partition, (value, self.coords[step.axis], step.reduce_op))
        raise ValueError(f"the runtime cannot execute a {step.kind!r} step")


def lower(gm: fx.GraphModule, plan: Plan, param_names: list[str], *, coords, group_names,
          device: torch.device, overlap: bool = True, buffer_updates: Sequence[str] = ()
          ) -> LocalProgram:
    """This rank's local program for ``plan`` (``coords``: this rank's mesh coordinate).

    ``overlap``: wait for each collective only where its result is first used
    (``runtime.overlap``), so communication runs behind the computation that follows.
    """
    strategies = {s.node: s for s in plan.strategies}
    reshards = {(r.consumer, r.slot): r.steps for r in plan.reshards}
    graph = fx.Graph()
    emit = _Emitter(graph, plan.mesh_shape, coords, group_names)
    env: dict[str, fx.Node] = {}
    placeholders = []
    loss_value, grad_values, grad_steps, update_values = None, [], [], []

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = graph.placeholder(node.name)
            placeholders.append(value)
            env[node.name] = emit.steps(value, reshards.get((node.name, "input"), ()))
        elif node.op == "call_function" and node.target is operator.getitem:
            producer, index = node.args
            env[node.name] = graph.call_function(operator.getitem, (env[producer.name], index))
        elif node.op == "call_function":
            slots = itertools.count()

            def local_arg(a, name=node.name):
                if not isinstance(a, fx.Node):
                    return a
                return emit.steps(env[a.name], reshards.get((name, next(slots)), ()))

            args = tree_map(local_arg, list(node.args))
            kwargs = {k: tree_map(local_arg, v) for k, v in node.kwargs.items()}
            target, args, kwargs = localize(node, args, kwargs, strategies[node.name],
                                            plan.mesh_shape, device, coords)
            env[node.name] = graph.call_function(target, tuple(args), kwargs)
        elif node.op == "output":
            outs = node.args[0]
            loss_value = emit.steps(env[outs[0].name], reshards.get((OUTPUT, "loss"), ()))
            for fqn, g in zip(param_names, outs[1:]):
                grad_values.append(None if g is None else env[g.name])
                grad_steps.append(reshards.get((OUTPUT, f"grad:{fqn}"), ()))
            for fqn, u in zip(buffer_updates, outs[1 + len(param_names):]):
                update_values.append(emit.steps(env[u.name],
                                                reshards.get((OUTPUT, f"buffer:{fqn}"), ())))
    forward, backward = _split(graph, placeholders, loss_value, grad_values, update_values)
    reduce_grads = _reduce_program(plan, coords, group_names,
                                   [s for g, s in zip(grad_values, grad_steps) if g is not None])
    fuse_gradient_buckets(reduce_grads, gradient_buckets(plan), group_sizes=plan.mesh_shape,
                          grad_names=[f for f, g in zip(param_names, grad_values) if g is not None])
    if overlap:
        for gm in (forward, backward, reduce_grads):
            overlap_collectives(gm)
    return LocalProgram(forward=forward, backward=backward, reduce_grads=reduce_grads,
                        buffer_updates=tuple(buffer_updates))


def _reduce_program(plan: Plan, coords, group_names, steps_per_grad) -> fx.GraphModule:
    """(raw grads...) -> the same grads after the plan's output resharding steps."""
    graph = fx.Graph()
    emit = _Emitter(graph, plan.mesh_shape, coords, group_names)
    outs = [emit.steps(graph.placeholder(f"grad_{i}"), steps)
            for i, steps in enumerate(steps_per_grad)]
    graph.output(tuple(outs))
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph, "ReduceGrads")


def _ancestors(value: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [value]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _split(graph: fx.Graph, placeholders, loss_value, grad_values, update_values=()):
    """Forward = what the loss (and the buffers' new values) depend on; backward = the
    rest, fed by saved values."""
    forward_nodes = _ancestors(loss_value) | set(placeholders)
    for u in update_values:
        forward_nodes |= _ancestors(u)
    # take a multi-output op's items in forward too (free), so backward saves tensors, not
    # tuples (autograd's save_for_backward holds tensors only)
    forward_nodes |= {u for n in forward_nodes for u in n.users
                      if u.op == "call_function" and u.target is operator.getitem}
    fwd, fenv = fx.Graph(), {}
    for n in graph.nodes:
        if n in forward_nodes:
            fenv[n] = fwd.node_copy(n, lambda x: fenv[x])
    saved = [n for n in graph.nodes if n in forward_nodes
             and (any(u not in forward_nodes for u in n.users) or n in grad_values)]
    fwd.output((fenv[loss_value], *[fenv[n] for n in update_values], *[fenv[n] for n in saved]))
    bwd, benv = fx.Graph(), {}
    for n in saved:
        benv[n] = bwd.placeholder(f"saved_{n.name}")
    for n in graph.nodes:
        if n not in forward_nodes and n.op != "output":
            benv[n] = bwd.node_copy(n, lambda x: benv[x])
    bwd.output(tuple(None if g is None else benv[g] for g in grad_values))
    root = torch.nn.Module()
    fwd.lint()
    bwd.lint()
    return fx.GraphModule(root, fwd, "LocalForward"), fx.GraphModule(root, bwd, "LocalBackward")
