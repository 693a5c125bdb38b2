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
all-gathers of a program input, or of a value made from inputs alone: a parameter cast to
the compute dtype, transposed -- mixed precision's cast gathers, whose cast moves with
them) as soon as the previous one has been waited for, so it is in flight while the
computation that reads the previous parameter runs -- FSDP2's prefetch, one parameter
ahead: at most one more gathered parameter is alive at a time.
The same collectives are issued, a parameter's gather now possibly before an activation's
collective that preceded it; every rank of the group runs the same program, so the ranks
still issue them in one agreed order.
"""

from __future__ import annotations

import torch
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
    """Move each all-gather of a value made from program inputs alone (a sharded
    parameter, or its cast to the compute dtype and its transposes: a cast gather) to
    right after the wait of the previous one, with the ops that make its input, when it
    was issued later (in place, after ``overlap_collectives``); returns how many issues
    moved."""
    graph = gm.graph
    chains: dict[fx.Node, list[fx.Node]] = {}
    made_of_inputs: dict[fx.Node, bool] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _GATHERS and isinstance(n.args[0], fx.Node) \
                and _of_inputs(n.args[0], made_of_inputs):
            chains[n] = _ancestors(n)
    issues = list(chains)
    moved, order = 0, {}
    for previous, current in zip(issues, issues[1:]):
        order = order or {n: i for i, n in enumerate(graph.nodes)}
        waits = [u for u in previous.users if u.target in _FINISHES]
        if len(waits) != 1 or order[current] < order[waits[0]]:
            continue                    # issued before that wait already
        wait = waits[0]
        late = [n for n in chains[current] if order[n] > order[wait]]
        if all(order[n] == order[wait] + 1 + i for i, n in enumerate(late)):
            continue                    # right after it already
        anchor = wait
        for n in late:                  # issued right after the previous wait
            anchor.append(n)
            anchor = n
        moved, order = moved + 1, {}
    if moved:
        graph.lint()
        gm.recompile()
    return moved


_GATHERS = (C.issue_all_gather, C.issue_all_gather_strided)
_FINISHES = (C.finish_all_gather, C.finish_all_gather_strided)
_LOCAL_STEPS = (C.local_chunk, C.local_partition)


def _of_inputs(node: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """Whether ``node``'s value is made from the program's inputs alone, by ops that may
    run earlier without changing any result: no collective, no random draw, no op without
    inputs (a constant is made where it is)."""
    if node not in memo:
        if node.op == "placeholder":
            memo[node] = True
        elif node.op != "call_function" or not node.all_input_nodes:
            memo[node] = False
        else:
            target = node.target
            pure = target in _LOCAL_STEPS or (
                isinstance(target, torch._ops.OpOverload)
                and torch.Tag.nondeterministic_seeded not in target.tags)
            memo[node] = pure and all(_of_inputs(a, memo) for a in node.all_input_nodes)
    return memo[node]


def _ancestors(issue: fx.Node) -> list[fx.Node]:
    """The ops ``issue`` reads, directly or not (placeholders aside), then ``issue``, in
    program order."""
    seen: set[fx.Node] = set()
    stack = [issue]
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in issue.graph.nodes if n in seen]
