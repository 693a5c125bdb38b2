"""Lower a Plan over the source graph to this rank's local programs: ONE lowering.

The source graph is the captured joint step ``(params, buffers, inputs) -> (loss, *grads,
*buffer updates)`` on global shapes. Lowering takes the part of it one rank computes (a
``GraphSlice``) through four steps, each in its own module:

1. ``runtime.lowering.local_graph.lower_slice``: the slice, op by op, as local ops on local blocks,
   with the plan's resharding steps as collective calls before the ops that need them
   (one local joint graph: forward and backward together);
2. ``runtime.rewrites.program_rewrites.rewrite_joint_graph``: the rewrites that must see forward and
   backward together (what one saves for the other);
3. ``split_forward_backward``: the graph split into three programs, so it can sit behind
   ``loss.backward()`` or a pipeline schedule:

   - ``forward``: the loss, values sent to later stages, buffer updates, and what backward
     needs;
   - ``backward``: those values (and gradients received from later stages) -> each
     gradient as the last op left it (possibly a partial sum, or a layout other than its
     parameter's), and gradients sent to earlier stages;
   - ``reduce_grads``: the plan's final resharding of each gradient into its parameter's
     layout;
4. ``runtime.rewrites.program_rewrites.rewrite_split_programs``: the rewrites of those programs (parameters
   gathered once per step, gradient buckets, communication overlapped).

The programs a step then runs are derived from these by ``runtime.rewrites.program_rewrites.step_programs``:
every rewrite of a program is listed in ``runtime.rewrites.program_rewrites``, in order.

An intra-op plan is a one-stage pipeline whose slice is the whole graph (``lower``); a
pipeline stage's slice is its nodes plus the values it receives
(``runtime.execution.pipeline.lower_stage``). One builder (``build_programs``) serves both.

Every resharding step is linear, so gradients of several micro-batches can be summed
locally and reduced once (``reduce_grads`` runs once per optimizer step, not per
micro-batch), which is how gradient accumulation saves communication.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.fx as fx

from torchalpa.core.opgraph import ValueRef
from torchalpa.core.plan import OutputSlot, Plan, ReshardStep
from torchalpa.runtime.lowering.local_graph import (
    GraphSlice,
    LocalGraph,
    StepEmitter,
    lower_slice,
    received_name,
)
from torchalpa.runtime.lowering.rank_programs import StageProgram, ValueKey
from torchalpa.runtime.rewrites.program_rewrites import rewrite_joint_graph, rewrite_split_programs

__all__ = ["lower", "build_programs", "split_forward_backward"]


def lower(gm: fx.GraphModule, plan: Plan, param_names: list[str], *, coords, group_names,
          device: torch.device, overlap: bool = True, buffer_updates: Sequence[str] = (),
          buffer_names: Sequence[str] = (), num_micro_batches: int = 1) -> StageProgram:
    """This rank's local program for the intra-op ``plan`` (``coords``: this rank's mesh
    coordinate): a one-stage pipeline whose stage is the whole graph, wired as a stage
    that receives and sends nothing (``buffer_names``: the placeholders after the
    parameters that are buffers or frozen parameters; the rest are user inputs).

    ``overlap``: wait for each collective only where its result is first used
    (``runtime.rewrites.overlap``), so communication runs behind the computation that follows.
    ``num_micro_batches``: the step's; with more than one, the parameters' forward
    gathers run once per step, in buckets, as their own program (``runtime.rewrites.param_gather``).
    """
    nodes = list(gm.graph.nodes)
    outs = nodes[-1].args[0]
    assert nodes[-1].op == "output", "an fx graph ends with its output node"
    P = len(param_names)
    whole = GraphSlice(
        placeholders=tuple(n for n in nodes if n.op == "placeholder"),
        nodes=tuple(n for n in nodes if n.op == "call_function"),
        loss=outs[0], grads=tuple(zip(param_names, outs[1:1 + P])),
        updates=tuple(zip(buffer_updates, outs[1 + P:])))
    built = build_programs(gm, whole, plan, coords=coords, group_names=group_names,
                           device=device, overlap=overlap,
                           gathers_once=(num_micro_batches, P + len(buffer_names)))
    num_inputs = len(whole.placeholders) - P - len(buffer_names)
    return replace(built, params=list(param_names), buffers=list(buffer_names),
                   user_inputs=list(range(num_inputs)))


def build_programs(gm: fx.GraphModule, part: GraphSlice, plan: Plan, *, coords, group_names,
                   device: torch.device, overlap: bool = True,
                   bucketed: bool = True, gathers_once: tuple[int, int] = (1, 0)
                   ) -> StageProgram:
    """Lower ``part`` of the source graph ``gm`` under ``plan`` (the slice's intra-op
    plan) for the rank at mesh coordinate ``coords``: the four steps of the module
    docstring. The caller adds the wiring the slice does not know (parameter and buffer
    names, inputs, receives and sends).

    ``overlap``: collectives waited for where first used (``runtime.rewrites.overlap``).
    ``bucketed``: gradients' final collectives go out in buckets (``runtime.rewrites.buckets``).
    ``gathers_once``: (the step's micro-batches, how many placeholders are parameters and
    buffers): the reads ``param_gather.gathered_once`` names move to a program run once
    per step (a one-stage step's, whose state placeholders come first)."""
    local = lower_slice(gm, part, plan, coords=coords, group_names=group_names, device=device)
    rewrite_joint_graph(local.graph, device=device, keep=local.held(),
                        source_of=local.source_of)
    forward, backward = split_forward_backward(local)
    reshards = {(r.consumer, r.slot): r.steps for r in plan.reshards}
    present = [fqn for fqn, g in part.grads if g is not None]
    reduce_grads = _steps_program(
        [(f"grad_{i}", reshards.get(OutputSlot.grad(fqn).reshard_key(), ()))
         for i, fqn in enumerate(present)], plan.mesh_shape, coords, group_names, "ReduceGrads")
    num_micro_batches, num_state = gathers_once
    param_gathers = rewrite_split_programs(
        forward, backward, reduce_grads, plan, grad_names=present,
        num_micro_batches=num_micro_batches, num_state=num_state, bucketed=bucketed,
        overlap=overlap)
    return StageProgram(forward, backward, reduce_grads,
                        buffer_updates=tuple(fqn for fqn, _ in part.updates),
                        has_loss=part.loss is not None,
                        grad_present=[g is not None for _, g in part.grads],
                        summed_recvs=_summed_recvs(local, part, plan, coords, group_names),
                        summed_sends={key: _steps_program(
                            [(received_name(key), reshards.get(OutputSlot.send(
                                str(ValueRef(*key))).reshard_key(), ()))],
                            plan.mesh_shape, coords, group_names, "SummedSend")
                            for key in part.summed_sends},
                        param_gathers=param_gathers)


def _summed_recvs(local: LocalGraph, part: GraphSlice, plan: Plan, coords, group_names
                  ) -> list[tuple[ValueKey, int, fx.GraphModule]]:
    """For each gradient part another stage sends summed once per step: its key, the
    position of the gradient it is added to among the present ones, and the program laying
    the received sum out as that gradient's addend (the received value's input steps, then
    the add's operand steps)."""
    reshards = {(r.consumer, r.slot): r.steps for r in plan.reshards}
    present = [g for _, g in part.grads if g is not None]
    out = []
    for add_name, (key, slot) in local.summed_into.items():
        position = next(i for i, g in enumerate(present) if g.name == add_name)
        steps = (*reshards.get((received_name(key), "input"), ()),
                 *reshards.get((add_name, slot), ()))
        out.append((key, position, _steps_program(
            [(received_name(key), steps)], plan.mesh_shape, coords, group_names,
            "SummedGradient")))
    return out


def split_forward_backward(local: LocalGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward = what ``local.forward_out`` (loss, sends, buffer updates) depends on,
    returning those then the values backward needs; backward = the rest, fed by the saved
    values and ``local.backward_phs``, returning ``local.backward_out`` (None where a
    gradient is absent)."""
    graph, forward_out, backward_out = local.graph, local.forward_out, local.backward_out
    forward_nodes = set(local.forward_phs)
    for r in forward_out:
        forward_nodes |= _ancestors(r)
    # take a multi-output op's items in forward too (free), so backward saves tensors, not
    # tuples (autograd's save_for_backward holds tensors only)
    forward_nodes |= {u for n in forward_nodes for u in n.users
                      if u.op == "call_function" and u.target is operator.getitem}
    fwd, fenv = fx.Graph(), {}
    for n in graph.nodes:
        if n in forward_nodes:
            fenv[n] = fwd.node_copy(n, lambda x: fenv[x])
    returned = {n for n in backward_out if n is not None}
    saved = [n for n in graph.nodes if n in forward_nodes
             and (any(u not in forward_nodes for u in n.users) or n in returned)]
    fwd.output((*[fenv[n] for n in forward_out], *[fenv[n] for n in saved]))
    bwd, benv = fx.Graph(), {}
    for n in saved:
        benv[n] = bwd.placeholder(f"saved_{n.name}")
    for n in local.backward_phs:
        benv[n] = bwd.placeholder(n.name)
    for n in graph.nodes:
        if n not in forward_nodes and n.op != "output" and n not in benv:
            benv[n] = bwd.node_copy(n, lambda x: benv[x])
    bwd.output(tuple(None if n is None else benv[n] for n in backward_out))
    fwd.lint()
    bwd.lint()
    root = torch.nn.Module()
    return fx.GraphModule(root, fwd, "LocalForward"), fx.GraphModule(root, bwd, "LocalBackward")


def _ancestors(value: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [value]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _steps_program(inputs: Sequence[tuple[str, Sequence[ReshardStep]]], mesh_shape, coords,
                   group_names, name: str) -> fx.GraphModule:
    """``(*inputs) -> each input after its plan steps``: the gradients' final resharding
    (``reduce_grads``), or a received gradient sum laid out as the gradient it is added to."""
    graph = fx.Graph()
    emit = StepEmitter(graph, mesh_shape, coords, group_names)
    graph.output(tuple(emit.steps(graph.placeholder(n), steps) for n, steps in inputs))
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph, name)
