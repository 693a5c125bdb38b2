"""Leave the loss's all-reduce in flight after forward, waited for when the loss is read.

In a data-parallel step each rank computes its batch shard's part of the loss and one
all-reduce makes it the global value. DDP has no such collective; a forward program that
waits for it pays one collective latency per step (the slower rank's lag included) before
backward can start. A lowered forward program already issues its collectives as issue +
wait (``runtime.rewrites.overlap``). This pass moves the wait, and the few ops that compute the loss
from the waited value, out of the forward program into a small *finish* program: the
forward returns what that program reads (the issued collective's handle, and e.g. the
count of targets a cross-entropy divides by), and the runner runs it once the loss is
needed (after backward in ``train_step``), so the all-reduce overlaps with backward.

A mean loss is usually captured as ``all_reduce(sum of local terms) / count``: the
division follows the wait, so moving only the wait would miss it. The tail moved is every
op of the loss's computation that depends on a wait, provided nothing else in the program
reads it (then nothing else needs the waited value before backward). Same collective, same
bytes, same ops on the same values: the loss is bit for bit the one the source program
returns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from torchalpa.runtime.execution import collectives as C

__all__ = ["defer_loss_wait", "finish_program", "split_loss_tail", "MAX_TAIL_OPS", "FINISH"]

FINISH = {split.finish: split for split in C.SPLIT.values()}
MAX_TAIL_OPS = 16      # a loss's tail is a handful of scalar ops; more is not a loss's tail


def defer_loss_wait(forward: fx.GraphModule, index: int = 0
                    ) -> tuple[fx.GraphModule, Callable[[object], torch.Tensor]] | None:
    """A copy of ``forward`` whose output ``index`` (the loss) is what the loss's finish
    program reads (one tensor: the issued collective's handle; or a tuple), and the
    function that runs that program on it and returns the loss; None when the loss does
    not come from a collective's wait through ops only it uses (nothing to defer).
    ``forward`` is left unchanged (other callers, e.g. the profiler, get the finished loss)."""
    if not isinstance(forward, fx.GraphModule):      # compiled programs keep their waits
        return None
    split = split_loss_tail(forward, index)
    if split is None:
        return None
    graph, outs, loss, order, boundary = split
    finish = finish_program(forward, order, boundary, loss)
    new_outs = list(outs)
    new_outs[index] = boundary[0] if len(boundary) == 1 else tuple(boundary)
    graph.output(type(outs)(new_outs))
    for n in reversed(order):
        graph.erase_node(n)
    graph.lint()

    def wait(value) -> torch.Tensor:
        return finish(*(value if isinstance(value, tuple) else (value,)))

    return fx.GraphModule(forward, graph), wait


def split_loss_tail(forward: fx.GraphModule, index: int):
    """A copy of ``forward``'s graph (no output node yet) with its loss (output ``index``)
    and the loss's tail in it: ``(graph, outs, loss, order, boundary)``, ``order`` the
    tail's ops in program order, ``boundary`` the values they read from the rest of the
    program; None when the loss has no movable tail (``_tail``) or the program returns
    a value of the tail besides the loss."""
    graph = fx.Graph()
    outs = graph.graph_copy(forward.graph, {})      # the output's value, no output node
    if not isinstance(outs, (tuple, list)) or index >= len(outs):
        return None
    loss = outs[index]
    if not isinstance(loss, fx.Node) or sum(o is loss for o in outs) != 1:
        return None
    tail = _tail(loss)
    if tail is None or any(isinstance(o, fx.Node) and o in tail and o is not loss
                           for o in outs):     # the program returns a waited value too
        return None
    order = [n for n in graph.nodes if n in tail]
    boundary: list[fx.Node] = []          # values the tail reads from the rest of the program
    for n in order:
        for i in n.all_input_nodes:
            if i not in tail and i not in boundary:
                boundary.append(i)
    return graph, outs, loss, order, boundary


def _tail(loss: fx.Node) -> set[fx.Node] | None:
    """The ops of ``loss``'s computation that depend on a collective's wait, when the
    program reads none of them except through the loss (None: nothing to move, or not
    movable)."""
    depends: dict[fx.Node, bool] = {}

    def waits(n: fx.Node) -> bool:
        if n not in depends:
            depends[n] = n.op == "call_function" and (
                n.target in FINISH or any(waits(i) for i in n.all_input_nodes))
        return depends[n]

    tail: set[fx.Node] = set()
    stack = [loss]
    while stack:
        n = stack.pop()
        if n in tail or not waits(n):
            continue
        tail.add(n)
        if len(tail) > MAX_TAIL_OPS:
            return None
        if n.target not in FINISH:      # a wait's handle is issued in forward, as before
            stack.extend(n.all_input_nodes)
    if not tail:
        return None
    for n in tail:
        if n.op != "call_function":
            return None
        if not set(n.users) <= tail:          # another op needs the waited value before backward
            return None
        if n.target in FINISH and any(waits(i) for i in n.all_input_nodes):
            return None
    return tail


def finish_program(owner: fx.GraphModule, order: list[fx.Node], boundary: list[fx.Node],
                   loss: fx.Node) -> fx.GraphModule:
    """``(*boundary) -> loss``: the tail's ops, copied in program order (also the finish of
    a loss all-reduced in a bucket, ``runtime.rewrites.loss_in_bucket``, whose boundary starts with
    the wait)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {b: graph.placeholder(b.name) for b in boundary}
    for n in order:
        env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(env[loss])
    graph.lint()
    return fx.GraphModule(owner, graph, "FinishLoss")
