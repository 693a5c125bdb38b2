"""Attention's backward from what its forward saved, not from a second forward.

The captured ``torchalpa::sdpa_backward`` gets only the attention's inputs, so it runs the
attention forward again to differentiate it (``torchalpa/ops/attention.py``: the fused
kernels' saved statistics have no device-neutral name at capture time). Once a program is
lowered for a CPU rank the kernel is known: this pass rewrites each
``sdpa(q, k, v, mask, ...)`` whose backward reads the very same local values into
``sdpa_forward_saving`` (output and the kernel's log-sum-exp per query row) and that
backward into ``sdpa_backward_saved`` (the kernel's backward on both), as eager autograd
does. Splitting the local graph (``runtime.lowering.lower``, after this rewrite of the joint graph:
``runtime.rewrites.program_rewrites``) then saves the output and the
statistic for backward like any other value, so the memory is the program's own: the
statistic is ``(B, Hq, L)`` (1/head_dim of the attention output) and the output is
usually kept anyway (the output projection's backward reads it). The planner's memory
model does not count the statistic.

Same kernels as the recomputing backward runs on CPU, so the gradients are unchanged;
collectives are untouched. A learned mask's backward (``sdpa_bias_backward``) keeps
recomputing (the fused CPU kernel gives no mask gradient).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from torchalpa.ops import attention

__all__ = ["save_attention_statistics"]

_FORWARD = torch.ops.torchalpa.sdpa.default
_BACKWARD = torch.ops.torchalpa.sdpa_backward.default


def save_attention_statistics(graph: fx.Graph, device: torch.device,
                              keep: frozenset[fx.Node] = frozenset()) -> int:
    """Rewrite, in place, each attention forward/backward pair of the joint local
    ``graph`` that shares its inputs to save the forward's statistics (CPU only: other
    devices' kernels are chosen at run time). Returns the number of pairs rewritten.
    Nodes in ``keep`` stay (the lowering holds them as a stage's sends or outputs)."""
    if device.type != "cpu":
        return 0
    forwards: dict[tuple, fx.Node] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target is _FORWARD and not n.kwargs:
            forwards.setdefault(tuple(n.args), n)
    rewritten = 0
    for b in list(graph.nodes):
        if b.op != "call_function" or b.target is not _BACKWARD or b.kwargs:
            continue
        f = forwards.get(tuple(b.args[1:]))
        if f is None or f in keep or b in keep:
            continue
        query, key, value, mask, is_causal, scale, enable_gqa = f.args
        with graph.inserting_after(f):
            pair = graph.call_function(attention.sdpa_forward_saving, f.args)
        with graph.inserting_after(pair):
            out = graph.call_function(operator.getitem, (pair, 0))
        with graph.inserting_after(out):
            logsumexp = graph.call_function(operator.getitem, (pair, 1))
        f.replace_all_uses_with(out)
        graph.erase_node(f)
        del forwards[tuple(b.args[1:])]
        with graph.inserting_before(b):
            saved = graph.call_function(attention.sdpa_backward_saved, (
                b.args[0], query, key, value, mask, out, logsumexp, is_causal, scale,
                enable_gqa))
        b.replace_all_uses_with(saved)
        graph.erase_node(b)
        rewritten += 1
    return rewritten
