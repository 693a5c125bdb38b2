"""Overlap communication with computation in a local program.

A lowered program calls each collective of ``runtime.execution.collectives`` as one blocking step.
This pass splits every such call into an *issue* (the functional collective, which the
process group runs in the background) and a *wait* placed right before the value's first
use. A gradient reduced at the end of backward is then summed across ranks while the
rest of backward computes -- the overlap DDP gets from its reducer -- and independent
collectives (all the gradients of ``reduce_grads``) are in flight together.

The collectives issued, their order and their bytes are unchanged (every rank issues
them in program order), so the plan's list still equals what runs. The halves are
``runtime.execution.collectives``' own: each collective's layout arithmetic is written once.

``prefetch_parameter_gathers`` then starts each gather of a sharded parameter (ZeRO-3's
all-gathers of a program input) as soon as the previous one has been waited for, so it
is in flight while the computation that reads the previous parameter runs -- FSDP2's
prefetch, one parameter ahead: at most one more gathered parameter is alive at a time.
The same collectives are issued, a parameter's gather now possibly before an activation's
collective that preceded it; every rank of the group runs the same program, so the ranks
still issue them in one agreed order.
"""

from __future__ import annotations

import torch.fx as fx

from torchalpa.runtime.execution import collectives as C

__all__ = ["overlap_collectives", "prefetch_parameter_gathers"]


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
        issue.meta.update(node.meta)      # e.g. which plan step it runs (lower.PLAN_STEP)
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


def prefetch_parameter_gathers(gm: fx.GraphModule) -> int:
    """Move each all-gather of a program input (a sharded parameter) to right after the
    wait of the previous one, when it was issued later (in place, after
    ``overlap_collectives``); returns how many issues moved."""
    graph = gm.graph
    issues = [n for n in graph.nodes if n.op == "call_function"
              and n.target in (C.issue_all_gather, C.issue_all_gather_strided)
              and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"]
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved = 0
    for previous, current in zip(issues, issues[1:]):
        waits = [u for u in previous.users
                 if u.target in (C.finish_all_gather, C.finish_all_gather_strided)]
        if len(waits) != 1 or order[current] <= order[waits[0]] + 1:
            continue                    # issued before that wait already, or right after it
        waits[0].append(current)        # issued right after the previous wait
        moved += 1
    if moved:
        graph.lint()
        gm.recompile()
    return moved
