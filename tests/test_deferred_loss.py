"""The loss's all-reduce left in flight after forward (runtime/rewrites/deferred_loss.py), in one
process with a one-rank gloo group. Real ranks: tests/test_distributed.py checks that the
losses a data-parallel step returns still equal one device's."""

from __future__ import annotations

import torch
import torch.fx as fx

from torchalpa.runtime.execution import collectives as C
from torchalpa.runtime.rewrites.deferred_loss import defer_loss_wait
from torchalpa.runtime.rewrites.overlap import overlap_collectives


def forward_program(group: str, *, reduce_loss: bool) -> fx.GraphModule:
    """(x) -> (mean loss, all-reduced when ``reduce_loss``; a saved value), overlapped as
    the lowering does."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    loss = graph.call_function(torch.mean, (graph.call_function(torch.square, (x,)),))
    if reduce_loss:
        loss = graph.call_function(C.all_reduce, (loss, "sum", group))
    saved = graph.call_function(torch.sin, (x,))
    graph.output((loss, saved))
    return overlap_collectives(fx.GraphModule(torch.nn.Module(), graph))


def names(gm: fx.GraphModule) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
            if n.op == "call_function"]


def test_the_loss_comes_back_issued_and_its_wait_gives_the_same_value(one_rank_group):
    forward = forward_program(one_rank_group, reduce_loss=True)
    deferred = defer_loss_wait(forward)
    assert deferred is not None
    program, wait = deferred
    assert names(program).count("issue_all_reduce") == 1
    assert "finish_all_reduce" not in names(program)
    assert "finish_all_reduce" in names(forward)      # the source program keeps its wait
    x = torch.randn(6)
    handle, saved = program(x)
    want_loss, want_saved = forward(x)
    assert torch.equal(wait(handle), want_loss) and torch.equal(saved, want_saved)


def test_a_loss_without_a_collective_is_left_alone(one_rank_group):
    assert defer_loss_wait(forward_program(one_rank_group, reduce_loss=False)) is None


def test_a_program_that_is_not_a_graph_is_left_alone():
    assert defer_loss_wait(lambda x: (x.sum(),)) is None      # pyright: ignore[reportArgumentType]


# -- a mean loss's whole tail (wait, then the division by the count of targets) ------------

def mean_loss_program(group: str, *, also_save_total: bool = False) -> fx.GraphModule:
    """(x, y) -> (all_reduce(sum((x - y)^2)) / count(y), a saved value), overlapped as the
    lowering does: the wait is followed by a division, as a captured cross-entropy's is."""
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    diff = graph.call_function(torch.sub, (x, y))
    local = graph.call_function(torch.sum, (graph.call_function(torch.square, (diff,)),))
    total = graph.call_function(C.all_reduce, (local, "sum", group))
    count = graph.call_function(torch.tensor, (float(6),))
    loss = graph.call_function(torch.div, (total, count))
    saved = total if also_save_total else graph.call_function(torch.sin, (x,))
    graph.output((loss, saved))
    return overlap_collectives(fx.GraphModule(torch.nn.Module(), graph))


def test_a_mean_losss_wait_and_division_move_out_of_forward(one_rank_group):
    forward = mean_loss_program(one_rank_group)
    deferred = defer_loss_wait(forward)
    assert deferred is not None
    program, finish = deferred
    assert "issue_all_reduce" in names(program)
    assert "finish_all_reduce" not in names(program) and "div" not in names(program)
    assert "finish_all_reduce" in names(forward)          # the source keeps its wait
    x, y = torch.randn(6), torch.randn(6)
    pending, saved = program(x, y)
    assert isinstance(pending, tuple) and len(pending) == 2   # the handle and the count
    want_loss, want_saved = forward(x, y)
    assert torch.equal(finish(pending), want_loss) and torch.equal(saved, want_saved)


def test_a_waited_value_read_elsewhere_keeps_the_wait_in_forward(one_rank_group):
    assert defer_loss_wait(mean_loss_program(one_rank_group, also_save_total=True)) is None
