"""Overlap communication with computation in a local program.

A lowered program calls each collective of ``runtime.collectives`` as one blocking step.
This pass splits every such call into an *issue* (the functional collective, which the
process group runs in the background) and a *wait* placed right before the value's first
use. A gradient reduced at the end of backward is then summed across ranks while the
rest of backward computes -- the overlap DDP gets from its reducer -- and independent
collectives (all the gradients of ``reduce_grads``) are in flight together.

The collectives issued, their order and their bytes are unchanged (every rank issues
them in program order), so the plan's list still equals what runs. The halves are
``runtime.collectives``' own: each collective's layout arithmetic is written once.
"""

from __future__ import annotations

import torch.fx as fx

from torchalpa.runtime import collectives as C

__all__ = ["overlap_collectives"]


def overlap_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """Split blocking collective calls of ``gm`` into issue + late wait (in place)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    changed = False
    for node in list(graph.nodes):
        split = C.SPLIT.get(node.target) if node.op == "call_function" else None  # pyright: ignore
        if split is None or not node.users:
            continue
        with graph.inserting_before(node):
            issue = graph.call_function(split.issue, node.args, node.kwargs)
        first_user = min(node.users, key=order.__getitem__)
        with graph.inserting_before(first_user):
            finish = graph.call_function(split.finish,
                                         (issue, *[node.args[i] for i in split.finish_args]))
        node.replace_all_uses_with(finish)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm
