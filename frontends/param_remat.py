"""Give backward its own views of the parameters instead of forward's (ZeRO-3).

Forward reads a parameter through views (a transpose for a Linear, a cast under mixed
precision); autograd's backward reads those same views, so whatever layout forward
brought them into (a gathered, whole weight) stays alive until backward. FSDP's
reshard-after-forward and ZeRO-3 gather parameters again in backward instead. This pass
copies, right before their first backward reader, the chains of view ops that lead from
a parameter to values backward reads, so the planner sees a parameter read in backward
on its own (gathered again there) and forward's copy dies after forward.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from torchalpa.frontends.joint_graph import ancestor_names

__all__ = ["rematerialize_parameter_views", "PARAMETER_VIEWS"]

aten = torch.ops.aten
_VIEWS = {aten.permute.default, aten.t.default, aten.transpose.int, aten.view.default,
          aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten._to_copy.default,
          aten.clone.default}
PARAMETER_VIEWS = frozenset(_VIEWS)
"""The ops through which forward reads a parameter (views, casts, copies): the chains
this pass gives backward copies of."""


def rematerialize_parameter_views(gm: fx.GraphModule, num_params: int) -> int:
    """Rewrite ``gm`` (the joint step; its first ``num_params`` placeholders are the
    trainable parameters) in place; returns how many view ops were copied."""
    copied = rematerialize_graph_views(gm.graph, num_params)
    gm.recompile()
    return copied


def rematerialize_graph_views(graph: fx.Graph, num_params: int) -> int:
    """``rematerialize_parameter_views`` on the graph alone (its module's code is left to
    the caller, who may edit more before making it)."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    params = [n for n in nodes if n.op == "placeholder"][:num_params]
    output = next(n for n in nodes if n.op == "output")
    forward = ancestor_names([output.args[0][0]])
    derived: dict[fx.Node, bool] = {p: True for p in params}
    for n in nodes:
        if n.op == "call_function" and n.target in _VIEWS and n.name in forward \
                and isinstance(n.args[0], fx.Node) and n.args[0] in derived:
            derived[n] = True
    readers = sorted(((u, n) for n in derived if n not in params for u in n.users
                      if u.name not in forward and u.op != "output"),
                     key=lambda pair: position[pair[0]])
    copies: dict[fx.Node, fx.Node] = {}

    def copy_of(n: fx.Node, before: fx.Node) -> fx.Node:
        if n in params:
            return n
        if n not in copies:
            first = n.args[0]
            assert isinstance(first, fx.Node), "a derived view reads a node"
            source = copy_of(first, before)
            with graph.inserting_before(before):
                c = graph.node_copy(n, lambda a: source if a is n.args[0] else a)
            c.meta = dict(n.meta)
            copies[n] = c
        return copies[n]

    for user, view in readers:
        user.replace_input_with(view, copy_of(view, user))
    graph.lint()
    return len(copies)
