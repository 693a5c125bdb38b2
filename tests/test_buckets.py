"""Bucketed gradient collectives (runtime/rewrites/buckets.py) in one process: which gradients share
a bucket, what a step then issues, the pass's rewrite, and the pack / unpack helpers
against a simulation of the ranks' collectives. Real ranks: tests/test_distributed.py
(data_parallel, zero3) and tests/test_runtime_dist.py (micro_dp) count the buckets."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from torchalpa.core.placement import Partial, Replicate, Shard
from torchalpa.core.plan import (
    OUTPUT,
    Collective,
    OutputSlot,
    Plan,
    Reshard,
    ReshardStep,
    ValuePlacement,
)
from torchalpa.runtime.execution import collectives as C
from torchalpa.runtime.measurement.issued import issued_collectives
from torchalpa.runtime.rewrites.buckets import (
    DEFAULT_BUCKET_BYTES,
    bucket_threshold,
    flatten_concat,
    fuse_gradient_buckets,
    gradient_buckets,
    interleave_chunks,
    split_chunks,
    split_flat,
)

MESH = (4, 2)
P, R = Partial("sum"), Replicate()


def grad_step(kind, axis, numel, itemsize=4, dim=None, src=(P, R)):
    return ReshardStep(kind=kind, axis=axis, bytes=numel * itemsize, src=src, dst=(R, R),
                       dim=dim, reduce_op="sum")


def make_plan(grads, *, threshold=None, activation_steps=1) -> Plan:
    """A plan whose reshards are ``activation_steps`` forward all-reduces, then one final
    resharding per gradient; grads: (name, shape, step)."""
    reshards = [Reshard("mm", 0, "relu", 0, (grad_step("all_reduce", 0, 16),))
                for _ in range(activation_steps)]
    reshards += [Reshard(f"g_{name}", 0, OUTPUT, OutputSlot.grad(name), (step,))
                 for name, _, step in grads]
    collectives = tuple(Collective(kind=s.kind, axis=s.axis, bytes=s.bytes, phase="backward",
                                   source="", tensor=r.producer, reduce_op=s.reduce_op)
                        for r in reshards for s in r.steps)
    return Plan(mesh_shape=MESH, axis_names=("dp", "tp"),
                parameters=tuple(ValuePlacement(n, f"p_{n}", shape, (R, R))
                                 for n, shape, _ in grads),
                inputs=(), strategies=(), reshards=tuple(reshards), collectives=collectives,
                method={"auto_sharding_option": {"all_reduce_threshold": threshold}})


def test_threshold_defaults_to_ddp_and_follows_the_option():
    assert bucket_threshold(make_plan([])) == DEFAULT_BUCKET_BYTES == 25 * 2 ** 20
    assert bucket_threshold(make_plan([], threshold=1024)) == 1024


def test_buckets_group_by_axis_op_and_dtype_in_backward_order():
    grads = [("a", (8, 8), grad_step("all_reduce", 0, 64)),
             ("b", (8,), grad_step("all_reduce", 0, 8)),
             ("c", (8, 8), grad_step("all_reduce", 1, 64)),          # another axis
             ("d", (8, 8), grad_step("all_reduce", 0, 64, itemsize=2)),   # bf16
             ("e", (8, 8), grad_step("all_reduce", 1, 64)),
             ("f", (8, 8), grad_step("all_reduce", 0, 64))]
    buckets = gradient_buckets(make_plan(grads))
    # in the order their first gradient is ready
    assert [(b.axis, b.params, b.bytes) for b in buckets] == [
        (0, ("f", "b", "a"), 256 + 32 + 256), (1, ("e", "c"), 2 * 256)]
    # the plan lists collective 0 (the activation), then the gradients' in order
    assert buckets[0].positions == (6, 2, 1)


def test_unset_threshold_caps_the_first_bucket_like_ddp():
    # 300 KiB gradients: 1 MiB holds 3 of them, then 25 MiB buckets take the rest
    grads = [(f"w{i}", (300, 256), grad_step("all_reduce", 0, 300 * 256)) for i in range(8)]
    buckets = gradient_buckets(make_plan(grads))
    assert [len(b.params) for b in buckets] == [3, 5]
    assert buckets[0].params == ("w7", "w6", "w5")      # the last layers, ready first
    # a threshold the user set is used for every bucket
    assert [len(b.params) for b in gradient_buckets(make_plan(grads, threshold=2 ** 20))] == \
        [3, 3, 2]


def test_threshold_splits_buckets_and_singletons_stay_alone():
    grads = [(n, (8, 8), grad_step("all_reduce", 0, 64)) for n in "abcde"]
    buckets = gradient_buckets(make_plan(grads, threshold=2 * 256))
    assert [b.params for b in buckets] == [("e", "d"), ("c", "b")]   # "a" alone
    assert gradient_buckets(make_plan(grads, threshold=0)) == ()
    with pytest.raises(ValueError, match="threshold"):
        gradient_buckets(make_plan(grads), threshold=-1)


def test_issued_collectives_replace_members_by_their_bucket():
    grads = [(n, (8, 8), grad_step("all_reduce", 0, 64)) for n in "abc"]
    plan = make_plan(grads, activation_steps=2)
    issued = issued_collectives(plan, num_micro_batches=3)
    # 2 activations per micro-batch, the 3 gradients once as one bucket
    assert sorted(c.bytes for c in issued) == [64] * 6 + [3 * 256]
    assert len(plan.collectives) == 5


def reduce_program(kinds_and_dims):
    """(grad_0, grad_1, ...) -> each reduced on its own, as lower() emits them."""
    graph = fx.Graph()
    outs = []
    for i, (kind, dim) in enumerate(kinds_and_dims):
        g = graph.placeholder(f"grad_{i}")
        if kind == "all_reduce":
            outs.append(graph.call_function(C.all_reduce, (g, "sum", "group0")))
        else:
            r = graph.call_function(C.reduce_scatter, (g, dim, "sum", 4, "group0"))
            outs.append(graph.call_function(C.local_chunk, (r, 0, 1, 0)))
    graph.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_the_pass_issues_one_collective_per_bucket():
    grads = [(n, (8, 8), grad_step("all_reduce", 0, 64)) for n in "abc"]
    plan = make_plan(grads)
    gm = reduce_program([("all_reduce", None)] * 3)
    fuse_gradient_buckets(gm, gradient_buckets(plan), ["a", "b", "c"], group_sizes=MESH)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(C.all_reduce) == 1 and flatten_concat in targets
    # members packed in backward order: c, b, a
    flat = next(n for n in gm.graph.nodes if n.target is flatten_concat)
    assert [a.name for a in flat.args[0]] == ["grad_2", "grad_1", "grad_0"]


def test_the_pass_bucket_reduce_scatters_keeping_later_steps():
    grads = [(n, (8, 4), grad_step("reduce_scatter", 0, 32, dim=1)) for n in "ab"]
    gm = reduce_program([("reduce_scatter", 1)] * 2)
    fuse_gradient_buckets(gm, gradient_buckets(make_plan(grads)), ["a", "b"], group_sizes=MESH)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(C.reduce_scatter) == 1 and targets.count(C.local_chunk) == 2
    assert targets.count(operator.getitem) == 2


def test_packing_then_all_reduce_equals_each_reduced():
    torch.manual_seed(0)
    ranks = [[torch.randn(3, 5), torch.randn(7), torch.randn(2, 2, 2)] for _ in range(4)]
    reduced = sum(flatten_concat(r) for r in ranks)
    for got, *pieces in zip(split_flat(reduced, ranks[0]), *ranks):
        assert torch.equal(got, sum(pieces))


@pytest.mark.parametrize("dim", [0, 1])
def test_interleaving_then_reduce_scatter_leaves_each_rank_its_blocks(dim):
    n = 4
    torch.manual_seed(0)
    ranks = [[torch.randn(8, 4), torch.randn(4, 12)] for _ in range(n)]
    reduced = sum(interleave_chunks(r, dim, n) for r in ranks)
    for k in range(n):                       # rank k keeps part k of the reduced buffer
        got = split_chunks(reduced.chunk(n)[k], ranks[0], dim, n)
        for i, g in enumerate(got):
            want = sum(r[i] for r in ranks).chunk(n, dim)[k]
            assert torch.allclose(g, want) and g.shape == want.shape


def test_a_bucket_of_mixed_dtypes_is_a_clear_error():
    with pytest.raises(TypeError, match="all_reduce_threshold=0"):
        flatten_concat([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)])


def test_shard_source_layouts_count_local_elements():
    # a gradient sharded on axis 1 and partial on axis 0: its local block is half
    step = ReshardStep(kind="all_reduce", axis=0, bytes=32 * 4, src=(P, Shard(0)),
                       dst=(R, Shard(0)), reduce_op="sum")
    grads = [("a", (8, 8), step), ("b", (8, 8), step)]
    assert gradient_buckets(make_plan(grads))[0].params == ("b", "a")


# -- issuing gradient collectives inside backward (runtime/rewrites/reduce_in_backward.py) ------------

def test_backward_with_reduce_issues_each_collective_once_its_gradients_exist(one_rank_group):
    from torchalpa.runtime.rewrites.overlap import overlap_collectives
    from torchalpa.runtime.rewrites.reduce_in_backward import EARLY, backward_with_reduce

    def backward(s):                       # the last layer's gradient first, as backward does
        g_last = s * 2
        h = torch.cos(torch.sin(g_last) * 3)
        return h + 1, None, g_last

    bwd = fx.symbolic_trace(backward)
    graph = fx.Graph()
    outs = [graph.call_function(C.all_reduce, (graph.placeholder(f"grad_{i}"), "sum",
                                               one_rank_group)) for i in range(2)]
    graph.output(tuple(outs))
    reduce = overlap_collectives(fx.GraphModule(torch.nn.Module(), graph))
    fused = backward_with_reduce(bwd, reduce)
    order = [n.target for n in fused.graph.nodes if n.op == "call_function"]
    names = [getattr(t, "__name__", str(t)) for t in order]
    # g_last's all-reduce is issued before backward computes the rest; waits come last
    assert names.index("issue_all_reduce") < names.index("sin")
    assert names.count("issue_all_reduce") == 2 and names[-2:] == ["finish_all_reduce"] * 2
    assert sum(t in EARLY for t in order) == 2
    s = torch.randn(5)
    got = fused(s)
    want = backward(s)
    assert got[1] is None and torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


# -- a gradient reduced over two mesh axes: both steps bucketed ------------------------------

def two_axis_plan(names, shape=(8, 8)) -> Plan:
    """Gradients partial on both axes of MESH, each summed over axis 1 then axis 0."""
    numel = shape[0] * shape[1]
    reshards = [Reshard(f"g_{n}", 0, OUTPUT, OutputSlot.grad(n), (
        ReshardStep("all_reduce", 1, numel * 4, src=(P, P), dst=(P, R), reduce_op="sum"),
        ReshardStep("all_reduce", 0, numel * 4, src=(P, R), dst=(R, R), reduce_op="sum")))
        for n in names]
    collectives = tuple(Collective(kind=s.kind, axis=s.axis, bytes=s.bytes, phase="backward",
                                   source="", tensor=r.producer, reduce_op=s.reduce_op)
                        for r in reshards for s in r.steps)
    return Plan(mesh_shape=MESH, axis_names=("dp", "tp"),
                parameters=tuple(ValuePlacement(n, f"p_{n}", shape, (R, R)) for n in names),
                inputs=(), strategies=(), reshards=tuple(reshards), collectives=collectives,
                method={"auto_sharding_option": {"all_reduce_threshold": None}})


def test_a_gradient_summed_over_two_axes_is_bucketed_on_both():
    plan = two_axis_plan("abc")
    bucket, = gradient_buckets(plan)
    assert (bucket.axis, bucket.params, [s.axis for s in bucket.then]) == (1, ("c", "b", "a"), [0])
    assert bucket.then[0].positions == (5, 3, 1) and bucket.positions == (4, 2, 0)
    issued = issued_collectives(plan, num_micro_batches=2)
    # one all-reduce per axis for the three gradients, not one per gradient on axis 0
    assert sorted((c.kind, c.axis, c.bytes) for c in issued) == [
        ("all_reduce", 0, 3 * 256), ("all_reduce", 1, 3 * 256)]


def test_the_pass_reduces_a_two_axis_bucket_twice():
    calls = []

    class Ranks(fx.Interpreter):          # every rank of both groups holds the same part
        def call_function(self, target, args, kwargs):
            if target is C.all_reduce:
                calls.append(args[2])
                return args[0] * 2
            return super().call_function(target, args, kwargs)

    graph = fx.Graph()
    outs = []
    for i in range(3):
        g = graph.placeholder(f"grad_{i}")
        once = graph.call_function(C.all_reduce, (g, "sum", "tp"))
        outs.append(graph.call_function(C.all_reduce, (once, "sum", "dp")))
    graph.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    fuse_gradient_buckets(gm, gradient_buckets(two_axis_plan("abc")), ["a", "b", "c"],
                          group_sizes=MESH)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(C.all_reduce) == 2 and targets.count(flatten_concat) == 1
    grads = [torch.randn(8, 8) for _ in range(3)]
    got = Ranks(gm).run(*grads)
    assert calls == ["tp", "dp"]                 # axis 1's group first, as the plan lists
    assert all(torch.equal(g, 4 * x) for g, x in zip(got, grads))
