"""Leave the loss's all-reduce in flight after forward, waited for when the loss is read.

In a data-parallel step each rank computes the mean loss of its batch shard and one
all-reduce makes it the global mean. DDP has no such collective; a forward program that
waits for it pays one collective latency per step before backward can start. A lowered
forward program already issues its collectives as issue + wait (``runtime.overlap``); when
the wait's value is the loss output itself, this pass returns the issued handle instead and
hands back the wait, so the runner can finish it once the loss is needed (after backward
in ``train_step``): the all-reduce overlaps with backward. Same collective, same bytes,
same value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from torchalpa.runtime import collectives as C

__all__ = ["defer_loss_wait"]

_FINISH = {split.finish: split for split in C.SPLIT.values()}


def defer_loss_wait(forward: fx.GraphModule, index: int = 0
                    ) -> tuple[fx.GraphModule, Callable[[torch.Tensor], torch.Tensor]] | None:
    """A copy of ``forward`` whose output ``index`` (the loss) is the issued collective's
    handle, and the function that waits for it and returns the loss; None when the loss
    output is not directly a collective's wait (nothing to defer). ``forward`` is left
    unchanged (other callers, e.g. the profiler, still get the finished loss)."""
    if not isinstance(forward, fx.GraphModule):      # compiled programs keep their waits
        return None
    graph = fx.Graph()
    outs = graph.graph_copy(forward.graph, {})      # the output's value, no output node
    if not isinstance(outs, (tuple, list)) or index >= len(outs):
        return None
    finish = outs[index]
    if not (isinstance(finish, fx.Node) and finish.op == "call_function"
            and finish.target in _FINISH and not finish.users
            and sum(o is finish for o in outs) == 1):
        return None
    handle, *extra = finish.args
    if any(isinstance(a, fx.Node) for a in extra):
        return None
    new_outs = list(outs)
    new_outs[index] = handle
    graph.output(type(outs)(new_outs))
    graph.erase_node(finish)
    graph.lint()
    finish_fn = finish.target

    def wait(value: torch.Tensor) -> torch.Tensor:
        return finish_fn(value, *extra)    # pyright: ignore[reportCallIssue]

    return fx.GraphModule(forward, graph), wait
