"""A leaner per-step program (issue 19): a mean loss's whole tail (wait, then the division
by the count of targets) deferred past backward (runtime/deferred_loss.py), and
``torchalpa::batched_matmul`` run as its body (runtime/peephole.py). In one process with a
one-rank gloo group; real ranks: tests/test_distributed.py and tests/test_runtime.py."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from torchalpa.batched_matmul import batched_matmul
from torchalpa.runtime import collectives as C
from torchalpa.runtime.deferred_loss import defer_loss_wait
from torchalpa.runtime.overlap import overlap_collectives
from torchalpa.runtime.peephole import inline_batched_matmul


@pytest.fixture
def one_rank_group():
    """A gloo group of one rank in this process (collectives are identities)."""
    import torch.distributed as dist

    from torchalpa.runtime.mesh import init_distributed
    init_distributed()
    yield dist.group.WORLD.group_name  # pyright: ignore[reportOptionalMemberAccess]
    dist.destroy_process_group()


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


def names(gm: fx.GraphModule) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
            if n.op == "call_function"]


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


def product_program() -> fx.GraphModule:
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output(graph.call_function(torch.ops.torchalpa.batched_matmul.default, (a, b)))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_batched_matmul_runs_as_its_body_bit_for_bit():
    gm = product_program()
    a, b = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 4, 7)
    want = gm(a, b)
    assert torch.equal(want, batched_matmul(a, b))
    assert inline_batched_matmul(gm.graph) == 1
    gm.recompile()
    assert "batched_matmul" not in gm.code
    got = gm(a, b)
    assert torch.equal(got, want) and got.is_contiguous()


def test_a_held_product_is_left_alone():
    gm = product_program()
    held = frozenset(n for n in gm.graph.nodes if n.op == "call_function")
    assert inline_batched_matmul(gm.graph, keep=held) == 0
