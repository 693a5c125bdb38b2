"""Activation checkpointing as a graph pass: recompute each layer's forward in backward.

A training step keeps, from forward until backward, every value backward reads: for a
transformer layer that is a dozen activations of the size of its input or larger. Full
activation checkpointing (Megatron's ``--recompute-granularity full``, Alpa's
``use_remat``) keeps only each layer's *input* and recomputes the rest of the layer's
forward at the start of the layer's backward.

Here a *layer* is a block of the captured step (``torchalpa.core.opgraph.block_of``: the
subtree of a numbered child of a module list, ``layers.3``). The pass rewrites the joint fx
graph in place: for each block, the forward values that backward reads are computed again
by copies of the forward ops that make them, inserted right before the block's first
backward reader, and backward reads the copies. Lowering puts what is not an ancestor of
the loss in backward, so the copies run there, and forward's values die in forward. The
planner sees the rewritten graph: the recompute flops are backward ops it prices, and the
memory model's liveness sees the activations die early. No runtime code is involved.

What a block keeps from forward (never recomputed):
- what comes from outside it (its input, parameters, values of other blocks);
- its outputs (values later forward ops outside the block read: the next layer's input);
- random ops' results (a dropout mask drawn again would differ) and their parts, but a
  dropout's result: the recompute makes it again from its input and forward's mask
  (``input * mask * scale``, as ATen's dropout does), so a block keeps a one-byte mask
  per element where it kept the 16-bit result and the mask;
- with ``keep_parameter_values`` (parameters sharded between steps, ZeRO-1/2), what is
  computed from parameters alone (``parameter_values``: a weight's cast to the compute
  dtype, its transpose): the parameters do not change within a step, so the recompute
  would make the same tensor again -- and, from a sharded parameter, gather it again
  with every micro-batch (Megatron-DeepSpeed's ZeRO-1 gathers the bf16 weights once a
  step and holds them). Off otherwise: each micro-batch in flight would then hold its
  own copy, where recomputing a cast from a whole parameter costs one cheap kernel.

Selective checkpointing (``policy="selective"``, torchtitan's op-level policy) keeps the
results of the compute-heavy ops too -- matrix products, convolutions and attention
(``SELECTIVE_KEPT``) -- and recomputes only what is cheap to run again (norms,
activation functions, residual sums, softmax of hand-written attention): most of the
memory of full checkpointing's recompute-free cousin, at a small fraction of its extra
flops.

Recomputation repeats deterministic ops on the same inputs, so checkpointed training
computes the same numbers as plain training.
"""

from __future__ import annotations

import copy
import operator
import warnings
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from torchalpa.core.opgraph import block_of
from torchalpa.frontends.joint_graph import ancestor_names
from torchalpa.frontends.opset import RANDOM_OPS, SDPA_OP
from torchalpa.frontends.param_remat import PARAMETER_VIEWS, rematerialize_graph_views
from torchalpa.frontends.provenance import module_of
from torchalpa.frontends.repeated import find_repeated_blocks
from torchalpa.frontends.torch_export import Capture, to_opgraph, unchanged_ops
from torchalpa.ops.batched_matmul import BATCHED_MATMUL_OP

aten = torch.ops.aten

__all__ = ["checkpoint_blocks", "checkpoint_graph", "checkpointed_capture", "Recomputed", "POLICIES",
           "SELECTIVE_KEPT", "copied_codegen", "parameter_values", "lazy_graph_module"]

POLICIES = ("full", "selective")
"""How much of a block's forward backward recomputes: all of it, or all but the results of
the compute-heavy ops (``SELECTIVE_KEPT``)."""

SELECTIVE_KEPT = frozenset({
    "aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default",
    "aten._grouped_mm.default", "aten.convolution.default", BATCHED_MATMUL_OP, SDPA_OP,
})
"""Ops whose results selective checkpointing keeps from forward: matrix products,
convolutions and attention, whose recompute would cost as much as forward itself."""


@dataclass(frozen=True)
class Recomputed:
    """What the pass did: blocks checkpointed and forward ops copied into backward."""

    blocks: int
    ops: int
    total: int = 0
    """Blocks the step has (``blocks`` of them checkpointed)."""
    checkpointed: tuple[tuple[str, int], ...] = ()
    """The checkpointed blocks (``block_of`` keys): a pipeline stage boundary inside one
    would leave its later part recomputing from its earlier part's recompute, made in an
    earlier stage's backward (``passes/pipeline_search/layers.py`` cuts between them)."""


def _made_by(n: fx.Node, ops: frozenset) -> bool:
    """Whether ``n`` is the result (or a part of the tuple result) of one of ``ops``."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        return _made_by(n.args[0], ops)
    return str(n.target) in ops or n.target in ops


def _is_random(n: fx.Node) -> bool:
    return _made_by(n, RANDOM_OPS)


_DROPOUT = "aten.native_dropout.default"


def _dropout_parts(n: fx.Node) -> tuple[fx.Node, fx.Node, float] | None:
    """For the result part (``getitem 0``) of a training-mode ``native_dropout`` whose mask
    part (``getitem 1``) is in the graph: (its input, the mask, the scale). The recompute
    makes it again as ``input * mask * scale``, the mask kept from forward."""
    if n.op != "call_function" or n.target is not operator.getitem or n.args[1] != 0:
        return None
    drop = n.args[0]
    if not isinstance(drop, fx.Node) or str(drop.target) != _DROPOUT or len(drop.args) < 3 \
            or drop.args[2] is False or not isinstance(drop.args[0], fx.Node):
        return None
    masks = [u for u in drop.users if u.target is operator.getitem and u.args[1] == 1]
    p = drop.args[1]
    if not masks or not isinstance(p, (int, float)) or p >= 1.0:
        return None
    return drop.args[0], masks[0], 1.0 / (1.0 - p)


def _blocks(graph: fx.Graph, forward: set[str]) -> dict[tuple[str, int], list[fx.Node]]:
    """Forward ops of each block, in graph order, with the parts (``getitem``) of their
    tuple results: a part only backward reads (layer norm's mean) is no ancestor of the
    loss, yet it is made where forward makes the tuple."""
    blocks: dict[tuple[str, int], list[fx.Node]] = {}
    block_of_node: dict[fx.Node, tuple[str, int]] = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is operator.getitem and n.args[0] in block_of_node:
            key = block_of_node[n.args[0]]
        elif n.name in forward:
            key = block_of(module_of(n))
        else:
            continue
        if key is not None:
            block_of_node[n] = key
            blocks.setdefault(key, []).append(n)
    return blocks


def parameter_values(graph: fx.Graph, num_params: int,
                     forward: set[str] | None = None) -> set[fx.Node]:
    """The nodes computed from the first ``num_params`` placeholders (the parameters)
    alone, no random op among them: casts and views of the weights. Empty where backward
    reads a parameter through views of its own (``param_remat``, ZeRO-3 and FSDP gather
    it again in backward: forward's copy must not be held for backward); ``forward``:
    the names of the forward ops (default: the ancestors of the loss)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    params = set(placeholders[:num_params])
    if forward is None:
        output = next(n for n in graph.nodes if n.op == "output")
        forward = ancestor_names([output.args[0][0]])
    if any(n.op == "call_function" and n.target in PARAMETER_VIEWS and n.name not in forward
           and n.args and n.args[0] in params for n in graph.nodes):
        return set()
    out: set[fx.Node] = set(params)
    for n in graph.nodes:
        if n.op == "call_function" and n.all_input_nodes and not _is_random(n) \
                and all(a in out for a in n.all_input_nodes):
            out.add(n)
    return out - set(placeholders)


def checkpoint_blocks(gm: fx.GraphModule, num_params: int, *,
                      policy: str = "full", blocks: int | None = None,
                      keep_parameter_values: bool = False) -> Recomputed:
    """Rewrite ``gm`` (the joint step returning ``(loss, *grads of its first num_params
    placeholders, *buffer updates)``) in place so each block's forward is recomputed in
    its backward: all of it (``policy="full"``) or all but the results of
    ``SELECTIVE_KEPT`` ops (``"selective"``). ``blocks``: only the first that many blocks
    (in forward's order) are checkpointed, the others keep their activations.
    ``keep_parameter_values``: what forward computed from the parameters alone is kept,
    not recomputed (module doc)."""
    done = checkpoint_graph(gm.graph, num_params, policy=policy, blocks=blocks,
                            keep_parameter_values=keep_parameter_values)
    gm.recompile()
    return done


def checkpoint_graph(graph: fx.Graph, num_params: int, *, policy: str = "full",
                     blocks: int | None = None, keep_parameter_values: bool = False
                     ) -> Recomputed:
    """``checkpoint_blocks`` on the graph alone (its module's code is left to the caller,
    who may edit more before making it)."""
    if policy not in POLICIES:
        raise ValueError(f"checkpointing policy must be one of {POLICIES}, got {policy!r}")
    position = {n: i for i, n in enumerate(graph.nodes)}
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    forward = ancestor_names([outs[0], *[o for o in outs[1 + num_params:] if o is not None]])
    num_ops = 0
    checkpointed: list[tuple[str, int]] = []
    found = list(_blocks(graph, forward).items())
    of_parameters = parameter_values(graph, num_params, forward) \
        if keep_parameter_values else set()
    if blocks is not None and blocks > len(found):
        raise ValueError(f"remat '{policy}:{blocks}' checkpoints {blocks} blocks, but the step "
                         f"has {len(found)}; use at most '{policy}:{len(found)}'")
    for key, members in found[:blocks]:
        inside = set(members)

        def kept(n: fx.Node) -> bool:
            """Saved from forward: made outside, read by forward outside, random, or (by
            the selective policy) the result of a compute-heavy op, or computed from the
            parameters alone (a weight's cast)."""
            return (n not in inside or (_is_random(n) and _dropout_parts(n) is None)
                    or n in of_parameters
                    or (policy == "selective" and _made_by(n, SELECTIVE_KEPT))
                    or any(u.name in forward and u not in inside for u in n.users))

        def backward_users(n: fx.Node) -> list[fx.Node]:
            return [u for u in n.users
                    if u not in inside and u.name not in forward and u.op != "output"]

        wanted = [n for n in members if not kept(n) and backward_users(n)]
        if not wanted:
            continue
        first = min((u for n in wanted for u in backward_users(n)), key=position.__getitem__)
        needed: set[fx.Node] = set()
        stack = list(wanted)
        while stack:
            n = stack.pop()
            if n in needed or kept(n):
                continue
            needed.add(n)
            parts = _dropout_parts(n)
            stack.extend(parts[:2] if parts else n.all_input_nodes)
        if any(position[a] >= position[first] for n in needed for a in n.all_input_nodes):
            continue      # a kept input is made after backward starts: leave the block as is
        copies: dict[fx.Node, fx.Node] = {}
        for n in sorted(needed, key=position.__getitem__):
            with graph.inserting_before(first):
                c = _copy(graph, n, copies)
            c.meta = dict(n.meta)
            copies[n] = c
        for n in wanted:
            for u in backward_users(n):
                u.replace_input_with(n, copies[n])
        checkpointed.append(key)
        num_ops += len(copies)
    graph.lint()
    return Recomputed(blocks=len(checkpointed), ops=num_ops, total=len(found),
                      checkpointed=tuple(checkpointed))


def lazy_graph_module(root, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)`` whose Python code is generated when first run or
    read (``.code``), not now: the planner derives many variants of a step (checkpointing
    modes, micro-batch sizes) and runs at most the one it chooses; generating and
    compiling each one's code took about half of a derivation (0.5 s of 1.1 s on
    LLaMA-3-8B at 8 layers). torch's own ``_LazyGraphModule`` where it has one."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:       # an older torch: the code is generated now
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def _copy(graph: fx.Graph, n: fx.Node, copies: dict[fx.Node, fx.Node]) -> fx.Node:
    """A recompute's copy of ``n``; a dropout's result made from its input and the mask
    forward drew (as ATen's dropout makes it: ``input * mask * scale``)."""
    parts = _dropout_parts(n)
    if parts is None:
        return graph.node_copy(n, lambda a: copies.get(a, a))
    x, mask, scale = parts
    kept = graph.call_function(aten.mul.Tensor, (copies.get(x, x), mask))
    kept.meta = dict(n.meta)
    return graph.call_function(aten.mul.Tensor, (kept, scale))


def copied_codegen(codegen):
    """A copy of a graph's codegen (its pytree in/out specs). Copying a leaf of those specs
    makes torch warn that ``LeafSpec`` is deprecated (torch 2.13: copyreg builds it anew,
    which the class's deprecation wrapper reports as the ``isinstance`` it means); the
    copy is the one torch's own specs would make, so that known warning is dropped here,
    and only here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is "
                                "deprecated", category=FutureWarning)
        return copy.deepcopy(codegen)


def checkpointed_capture(captured: Capture, policy: str = "full", *,
                         rematerialize_parameters: bool = False,
                         keep_parameter_values: bool = False) -> Capture:
    """The same captured step with every block checkpointed (``checkpoint_blocks`` with
    ``policy``; "none" checkpoints nothing) and, with ``rematerialize_parameters``,
    backward reading parameters through views of its own (``param_remat``: gathered again
    in backward, ZeRO-3), on a copy of its fx graph, and the OpGraph made again from it;
    ``captured`` is left untouched. Cheaper than tracing the model again, which is what
    lets the planner weigh the variants. ``policy`` may name a block count ("full:5": the
    first 5 blocks checkpointed, ``torchalpa.core.options.parse_remat``);
    ``keep_parameter_values``: as ``checkpoint_blocks`` (for parameters sharded between
    steps and not gathered again in backward: ZeRO-1/2)."""
    from torchalpa.core.options import parse_remat
    policy, first = parse_remat(policy)
    graph = fx.Graph()
    graph._codegen = copied_codegen(captured.gm.graph._codegen)
    graph.output(graph.graph_copy(captured.gm.graph, {}))
    # the rewrites edit the graph; the module and its code are made once, after the last
    if rematerialize_parameters:
        rematerialize_graph_views(graph, len(captured.param_names))
    done = checkpoint_graph(graph, len(captured.param_names), policy=policy, blocks=first,
                            keep_parameter_values=keep_parameter_values) \
        if policy != "none" else Recomputed(blocks=0, ops=0)
    graph.eliminate_dead_code()
    gm = lazy_graph_module(captured.gm, graph)
    kinds = ([("param", k) for k in captured.param_names]
             + [("buffer", k) for k in captured.buffer_names]
             + [("input", k) for k in captured.input_names])
    opgraph = to_opgraph(gm, kinds, captured.buffer_updates,
                         known=unchanged_ops(captured.gm.graph, captured.graph, graph))
    opgraph.meta.update(captured.graph.meta)
    opgraph.meta["repeated_blocks"] = find_repeated_blocks(opgraph)
    if policy != "none":
        opgraph.meta["remat"] = {"mode": policy, "blocks": done.blocks,
                                 "recomputed_ops": done.ops, "of": done.total,
                                 "first": first, "checkpointed": done.checkpointed}
    opgraph.check()
    return replace(captured, graph=opgraph, gm=gm)
