"""Backward and the gradients' collectives as one program, each issued once its gradients exist.

With one micro-batch, nothing is accumulated between backward and the gradients' final
resharding, so the two programs can run as one: ``backward_with_reduce`` inlines
``reduce_grads`` after ``backward`` and moves the part of it that *starts* each collective
(packing a bucket, issuing the functional collective) right after the last gradient it
reads. The waits stay at the end (where ``runtime.rewrites.overlap`` put them, before the first
use), so a bucket of the last layers' gradients is summed across ranks while backward
computes the earlier layers' -- DDP's overlap, from its reducer's hooks.

Every rank runs the same program, so all issue the collectives in the same order; which
collectives run, and their bytes, do not change (``runtime.measurement.comm_count`` still counts the
plan's list). With several micro-batches the gradients are summed over micro-batches
first, and the programs stay apart (``runtime.rewrites.program_rewrites.step_programs`` applies this pass
to one-micro-batch, one-stage steps only).
"""

from __future__ import annotations

import torch.fx as fx

from torchalpa.runtime.execution import collectives as C
from torchalpa.runtime.rewrites.buckets import bucket_shapes, flatten_concat, interleave_chunks

__all__ = ["backward_with_reduce", "EARLY"]

# what may run as soon as its inputs exist: packing and issuing, never a wait
EARLY = frozenset({bucket_shapes, flatten_concat, interleave_chunks, C.issue_all_reduce,
                   C.issue_reduce_scatter, C.issue_reduce_scatter_strided, C.issue_all_gather,
                   C.issue_all_gather_strided, C.issue_all_to_all})


def backward_with_reduce(backward: fx.GraphModule, reduce_grads: fx.GraphModule
                         ) -> fx.GraphModule:
    """One program ``(*saved) -> gradients in their layouts`` (None where ``backward``
    gives None), with each collective of ``reduce_grads`` issued where its inputs are
    ready. The inputs are left untouched."""
    graph = fx.Graph()
    raw = graph.graph_copy(backward.graph, {})       # the gradients, no output node yet
    assert isinstance(raw, (tuple, list)), "a backward program returns a tuple"
    # reduce_grads's inputs are the gradients that are not None, in order
    env: dict[fx.Node, fx.Node] = dict(zip(
        (n for n in reduce_grads.graph.nodes if n.op == "placeholder"),
        (g for g in raw if isinstance(g, fx.Node)), strict=True))
    outs = graph.graph_copy(reduce_grads.graph, env)
    assert isinstance(outs, (tuple, list)), "reduce_grads returns a tuple"
    reduced = iter(outs)
    graph.output(tuple(None if g is None else next(reduced) for g in raw))
    _issue_early(graph, [env[n] for n in reduce_grads.graph.nodes
                         if n.op == "call_function"])
    graph.lint()
    return fx.GraphModule(backward, graph, "BackwardWithReduce")


def _is_view(node: fx.Node) -> bool:
    """An ATen view (``t``, ``view``, ``transpose``...): no kernel, free to move up."""
    return node.op == "call_function" and bool(getattr(node.target, "is_view", False))


def _hoist_views(graph: fx.Graph, node: fx.Node) -> None:
    """Move the views ``node`` reads (and the views they read) right after their own
    latest input: a gradient that backward makes as ``mm(...).t()`` exists once the
    matmul has run, wherever the capture placed the transpose."""
    for view in node.all_input_nodes:
        if not _is_view(view):
            continue
        _hoist_views(graph, view)
        position = {n: i for i, n in enumerate(graph.nodes)}
        inputs = view.all_input_nodes
        if inputs:
            latest = max(inputs, key=position.__getitem__)
            if position[latest] + 1 < position[view]:
                latest.append(view)


def _issue_early(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Move each node of ``nodes`` that only packs or issues right after the latest of its
    inputs (in order, so a bucket's issue follows its packing), the views it reads moved
    up first; then each bucket's reading of its members' shapes right before its packing,
    so the members are last read by the packing and freed before the collective is
    issued: on gloo, which copies a reduce-scatter's input when it is issued, the
    members, the packed buffer and gloo's copy are never alive at once."""
    for node in nodes:
        if node.target not in EARLY:
            continue
        _hoist_views(graph, node)
        position = {n: i for i, n in enumerate(graph.nodes)}
        inputs = node.all_input_nodes
        if not inputs:
            continue
        latest = max(inputs, key=position.__getitem__)
        if position[latest] + 1 < position[node]:
            latest.append(node)
    packing = {_members(n): n for n in nodes if n.target in (flatten_concat, interleave_chunks)}
    for node in nodes:
        if node.target is bucket_shapes and _members(node) in packing:
            packing[_members(node)].prepend(node)


def _members(node: fx.Node) -> tuple:
    """The gradients a bucket's packing (or shapes reading) takes: its first argument."""
    members = node.args[0]
    return tuple(members) if isinstance(members, (list, tuple)) else (members,)
