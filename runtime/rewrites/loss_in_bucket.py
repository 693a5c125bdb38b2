"""A ``train_step``'s loss all-reduced inside a gradient bucket's: no collective of its own.

In a data-parallel step each rank computes its batch shard's part of the loss and one
all-reduce makes it the global value, so that every rank returns one device's loss. DDP
has no such collective. ``runtime.rewrites.deferred_loss`` already leaves it in flight during
backward, but on a network (gloo on CPU ranks, most of all) each collective still costs a
latency and a rendezvous of the ranks: on the zoo's ViT, whose gradients fit one bucket,
that 4-byte all-reduce made the step 1.06x DDP's. ``train_step`` reads the loss only
after backward, when the gradients' buckets have been reduced, so the loss's local part
can travel in one of them:

- the forward program stops before the loss's all-reduce and returns the local part (and
  whatever else the loss's tail reads, as ``defer_loss_wait`` does);
- the backward-and-reduce program (``runtime.rewrites.reduce_in_backward``) takes that part as one more
  input, appends it to the flat buffer of the last bucket all-reduced over the same group
  with the same reduce op (or a sum's, for a loss averaged over the ranks), and returns
  the reduced part after the gradients;
- a small *finish* program runs the loss's tail (e.g. the division by the count of
  targets) on the reduced part, an average first divided by the group's size (what gloo's
  ``avg`` does: bit for bit the same, checked on 4 ranks).

Reduction is elementwise, so the loss is the same sum of the ranks' parts. Not always bit
for bit: gloo's ring all-reduce adds an element's parts in an order that depends on where
it sits in the buffer, so the last bit may differ from the loss's own all-reduce's (as
either may from one device's). Every rank still gets the same value.

The plan lists it with ``buckets.LossInBucket`` (``issued_collectives(...,
loss_in_bucket=)``): the loss's collective is named by the plan step the lowering tagged it
with (``programs.PLAN_STEP``), the bucket by its index (``buckets.BUCKET``).

A step called as ``loss = pm(x, y); loss.backward()`` returns the loss before backward
runs, so it keeps the loss's own all-reduce.
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch
import torch.fx as fx
from torch.distributed.distributed_c10d import _resolve_process_group

from torchalpa.runtime.execution import collectives as C
from torchalpa.runtime.lowering.rank_programs import PLAN_STEP, LossInBucketPrograms
from torchalpa.runtime.rewrites.buckets import BUCKET, flatten_concat, split_flat
from torchalpa.runtime.rewrites.deferred_loss import FINISH, finish_program, split_loss_tail

__all__ = ["put_loss_in_gradient_bucket"]


def put_loss_in_gradient_bucket(forward: fx.GraphModule, backward_reduce: fx.GraphModule,
                                index: int = 0) -> LossInBucketPrograms | None:
    """The programs with the loss (output ``index`` of ``forward``) all-reduced inside a
    bucket of ``backward_reduce``; None when the loss's tail waits for anything but one all-reduce,
    or no bucket is all-reduced over that all-reduce's group with its reduce op. The
    inputs are left untouched."""
    if not isinstance(forward, fx.GraphModule) or not isinstance(backward_reduce, fx.GraphModule):
        return None
    split = split_loss_tail(forward, index)
    if split is None:
        return None
    graph, outs, loss, order, boundary = split
    waits = [n for n in order if n.target in FINISH]
    if len(waits) != 1 or waits[0].target is not C.finish_all_reduce:
        return None
    wait = waits[0]
    issue = wait.args[0]
    if not isinstance(issue, fx.Node) or issue.target is not C.issue_all_reduce \
            or set(issue.users) != {wait} or PLAN_STEP not in issue.meta:
        return None
    local, reduce_op, group = issue.args
    assert isinstance(group, str), f"a collective's group is named by a string, got {group!r}"
    reduce = _with_loss_in_bucket(backward_reduce, reduce_op, group)
    if reduce is None or not isinstance(local, fx.Node):
        return None
    backward, bucket, bucket_op = reduce
    # an average rides a sum: divided by the group's size after (as gloo's avg does)
    divisor = _resolve_process_group(cast(Any, group)).size() if bucket_op != reduce_op else None

    # the tail with the wait's value as its first input: the reduced part comes in there
    others = [b for b in boundary if b is not issue]
    finish = finish_program(forward, [n for n in order if n is not wait], [wait, *others], loss)
    new_outs = list(outs)
    new_outs[index] = (local, tuple(others))
    graph.output(type(outs)(new_outs))
    for n in reversed(order):
        graph.erase_node(n)
    graph.erase_node(issue)
    graph.lint()

    def finish_loss(reduced: torch.Tensor, values: tuple) -> torch.Tensor:
        if divisor is not None:
            reduced = torch.ops.aten.div.Tensor(reduced, divisor)
        return finish(reduced, *values)

    return LossInBucketPrograms(fx.GraphModule(forward, graph), backward, finish_loss,
                                tuple(issue.meta[PLAN_STEP]), bucket)


def _with_loss_in_bucket(program: fx.GraphModule, reduce_op, group
          ) -> tuple[fx.GraphModule, int, str] | None:
    """A copy of ``program`` taking one more input, packed into its last bucket
    all-reduced with ``reduce_op`` (a sum, for an ``avg``) over ``group`` and returned
    reduced after its outputs; that bucket's index and reduce op (None: no such bucket)."""
    ops = (reduce_op, "sum") if reduce_op == "avg" else (reduce_op,)
    graph = fx.Graph()
    outs = graph.graph_copy(program.graph, {})
    assert isinstance(outs, (tuple, list)), "a backward program returns a tuple"
    chosen = None
    for flat in graph.nodes:
        if flat.target is not flatten_concat or BUCKET not in flat.meta or len(flat.users) != 1:
            continue
        issue = next(iter(flat.users))
        if issue.target is not C.issue_all_reduce or issue.args[1] not in ops \
                or issue.args[2] != group or len(issue.users) != 1:
            continue
        wait = next(iter(issue.users))
        splits = list(wait.users)
        if wait.target is C.finish_all_reduce and len(splits) == 1 \
                and splits[0].target is split_flat:
            chosen = (flat, splits[0], issue.args[1])
    if chosen is None:
        return None
    flat, split, bucket_op = chosen
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]) if placeholders else \
            graph.inserting_before(next(iter(graph.nodes))):
        part = graph.placeholder("loss_local_part")
    assert isinstance(flat.args[0], (list, tuple)), "a bucket flattens a list of gradients"
    members = list(flat.args[0])
    flat.args = (members + [part],)
    split.args = (split.args[0], members + [part])
    with graph.inserting_after(split):
        reduced = graph.call_function(operator.getitem, (split, len(members)))
    graph.output((*outs, reduced))
    graph.lint()
    return fx.GraphModule(program, graph, "BackwardWithReduceAndLoss"), flat.meta[BUCKET], bucket_op
