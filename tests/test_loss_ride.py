"""The loss's all-reduce sent inside a gradient bucket's (runtime/rewrites/loss_in_bucket.py), on
hand-built programs in one process with a one-rank gloo group. Real ranks (one collective
per bucket, the loss still one device's): tests/test_distributed.py."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from torchalpa.runtime.execution import collectives as C
from torchalpa.runtime.lowering.rank_programs import PLAN_STEP
from torchalpa.runtime.rewrites.buckets import BUCKET, flatten_concat, split_flat
from torchalpa.runtime.rewrites.loss_in_bucket import put_loss_in_gradient_bucket
from torchalpa.runtime.rewrites.overlap import overlap_collectives


def names(gm: fx.GraphModule) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
            if n.op == "call_function"]


def forward_program(group: str, *, reduce_op: str = "sum", tagged: bool = True
                    ) -> fx.GraphModule:
    """(x, y) -> (all_reduce(sum((x - y)^2)) / 6, a saved value), overlapped as the
    lowering does, the all-reduce tagged with its plan step as the lowering tags it."""
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    local = graph.call_function(torch.sum, (graph.call_function(
        torch.square, (graph.call_function(torch.sub, (x, y)),)),))
    total = graph.call_function(C.all_reduce, (local, reduce_op, group))
    if tagged:
        total.meta[PLAN_STEP] = ("div", 0, 0)
    loss = graph.call_function(torch.div, (total, 6.0))
    graph.output((loss, graph.call_function(torch.sin, (x,))))
    return overlap_collectives(fx.GraphModule(torch.nn.Module(), graph))


def reduce_program(group: str, num_buckets: int = 2) -> fx.GraphModule:
    """(a, b, c, d) -> their all-reduces, in ``num_buckets`` buckets of the pairs (a, b)
    and (c, d) (or the pair (a, b) and c, d on their own), as fuse_gradient_buckets makes
    them."""
    graph = fx.Graph()
    grads = [graph.placeholder(n) for n in "abcd"]
    outs = []
    for index, members in enumerate([grads[:2], grads[2:]][:num_buckets]):
        flat = graph.call_function(flatten_concat, (members,))
        flat.meta[BUCKET] = index
        reduced = graph.call_function(C.all_reduce, (flat, "sum", group))
        parts = graph.call_function(split_flat, (reduced, members))
        outs += [graph.call_function(operator.getitem, (parts, i)) for i in range(2)]
    outs += [graph.call_function(C.all_reduce, (g, "sum", group)) for g in grads[len(outs):]]
    graph.output(tuple(outs))
    return overlap_collectives(fx.GraphModule(torch.nn.Module(), graph))


def test_the_loss_rides_the_last_bucket_and_comes_out_the_same(one_rank_group):
    forward, reduce = forward_program(one_rank_group), reduce_program(one_rank_group)
    ride = put_loss_in_gradient_bucket(forward, reduce)
    assert ride is not None and ride.plan_step == ("div", 0, 0) and ride.bucket == 1
    # forward issues no collective; backward issues one per bucket, as before
    assert "issue_all_reduce" not in names(ride.forward)
    assert names(ride.backward_reduce).count("issue_all_reduce") == \
        names(reduce).count("issue_all_reduce") == 2
    x, y = torch.randn(6), torch.randn(6)
    grads = [torch.randn(3, 2), torch.randn(4), torch.randn(5), torch.randn(2, 2)]
    (local, others), saved = ride.forward(x, y)
    *reduced, reduced_loss = ride.backward_reduce(*grads, local)
    want_loss, want_saved = forward(x, y)
    assert torch.equal(ride.finish(reduced_loss, others), want_loss)
    assert torch.equal(saved, want_saved)
    for got, want in zip(reduced, reduce(*grads), strict=True):
        assert torch.equal(got, want)


def test_a_loss_averaged_over_the_ranks_rides_a_sum_and_is_divided_after(one_rank_group):
    forward, reduce = forward_program(one_rank_group, reduce_op="avg"), \
        reduce_program(one_rank_group)
    ride = put_loss_in_gradient_bucket(forward, reduce)
    assert ride is not None and "issue_all_reduce" not in names(ride.forward)
    x, y = torch.randn(6), torch.randn(6)
    grads = [torch.randn(3, 2), torch.randn(4), torch.randn(5), torch.randn(2, 2)]
    (local, others), _ = ride.forward(x, y)
    *_, reduced_loss = ride.backward_reduce(*grads, local)
    assert torch.equal(ride.finish(reduced_loss, others), forward(x, y)[0])


def test_without_a_bucket_of_that_reduce_op_the_loss_keeps_its_all_reduce(one_rank_group):
    assert put_loss_in_gradient_bucket(forward_program(one_rank_group, reduce_op="max"),
                               reduce_program(one_rank_group)) is None
    assert put_loss_in_gradient_bucket(forward_program(one_rank_group),
                               reduce_program(one_rank_group, num_buckets=0)) is None


def test_an_all_reduce_the_plan_did_not_name_is_left_alone(one_rank_group):
    assert put_loss_in_gradient_bucket(forward_program(one_rank_group, tagged=False),
                               reduce_program(one_rank_group)) is None
