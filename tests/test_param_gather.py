"""Parameters gathered once per step with micro-batches (runtime/rewrites/param_gather.py), in one
process: which reads are hoisted, how they are bucketed, the unpacking of a bucketed
all-gather against simulated ranks, and the pass's rewrite. Real ranks:
tests/test_alpa_runs.py (ZeRO-2, 2 micro-batches: one all-gather per step)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from torchalpa.core.placement import Replicate, Shard
from torchalpa.core.plan import Collective, Plan, Reshard, ReshardStep, ValuePlacement
from torchalpa.runtime.execution import collectives as C
from torchalpa.runtime.measurement.issued import issued_collectives
from torchalpa.runtime.rewrites.buckets import flatten_concat
from torchalpa.runtime.rewrites.param_gather import (
    gather_buckets,
    gathered_once,
    hoist_parameter_gathers,
    split_gathered,
)

R, S0 = Replicate(), Shard(0)


def zero2_plan(*, rematerialize=False, threshold=None) -> Plan:
    """Two weights sharded on dim 0 over 4 ranks, gathered where forward reads them
    (``mm`` and ``add``), and an activation all-reduce in forward (not a parameter's)."""
    def gather(nbytes):         # what each rank contributes (4-byte elements)
        return ReshardStep("all_gather", 0, nbytes, src=(S0,), dst=(R,), dim=0)
    reshards = (Reshard("p_w", 0, "mm", 1, (gather(64),)),
                Reshard("p_b", 0, "add", 1, (gather(8),)),
                Reshard("mm", 0, "relu", 0, (ReshardStep("all_reduce", 0, 64, src=(S0,),
                                                         dst=(R,), reduce_op="sum"),)),
                Reshard("p_w", 0, "mm_bwd", 1, (gather(64),)))
    phases = ("forward", "forward", "forward", "backward")
    collectives = tuple(Collective(kind=r.steps[0].kind, axis=0, bytes=r.steps[0].bytes,
                                   phase=ph, source="", tensor=r.producer)
                        for r, ph in zip(reshards, phases))
    option = {"rematerialize_parameters": rematerialize, "all_reduce_threshold": threshold}
    return Plan(mesh_shape=(4,), axis_names=("dp",),
                parameters=(ValuePlacement("w", "p_w", (8, 8), (S0,)),
                            ValuePlacement("b", "p_b", (8,), (S0,))),
                inputs=(), strategies=(), reshards=reshards, collectives=collectives,
                method={"auto_sharding_option": option})


def test_forward_reads_of_parameters_are_gathered_once_with_micro_batches():
    plan = zero2_plan()
    assert gathered_once(plan, 1) == {}                   # one micro-batch: nothing to save
    # the backward re-gather and the activation's all-reduce are not parameters' forward reads
    assert gathered_once(plan, 2) == {("mm", 1): (0,), ("add", 1): (1,)}
    assert gathered_once(zero2_plan(rematerialize=True), 2) == {}     # ZeRO-3 holds less
    bucket, = gather_buckets(plan, 2)
    assert (bucket.readers, bucket.bytes, bucket.itemsize) == ((("mm", 1), ("add", 1)),
                                                               64 + 8, 4)
    assert gather_buckets(zero2_plan(threshold=0), 2) == ()


def test_the_step_lists_one_bucketed_gather_and_the_rest_per_micro_batch():
    issued = issued_collectives(zero2_plan(), num_micro_batches=3)
    assert sorted((c.kind, c.bytes) for c in issued) == \
        [("all_gather", 64)] * 3 + [("all_gather", 72)] + [("all_reduce", 64)] * 3
    # a pipeline stage gathers per micro-batch
    staged = issued_collectives(zero2_plan(), num_micro_batches=3, one_stage=False)
    assert sorted((c.kind, c.bytes) for c in staged) == \
        [("all_gather", 8)] * 3 + [("all_gather", 64)] * 6 + [("all_reduce", 64)] * 3


@pytest.mark.parametrize("dims", [(0, 0), (1, 0), (0, 2)])
def test_unpacking_a_bucketed_gather_equals_gathering_each(dims):
    n = 4
    torch.manual_seed(0)
    shapes = [(3, 2), (2, 5, 3)]
    ranks = [[torch.randn(s) for s in shapes] for _ in range(n)]
    gathered = torch.cat([flatten_concat(r) for r in ranks])    # what all_gather(dim 0) makes
    got = split_gathered(gathered, ranks[0], list(dims), n)
    for i, (g, d) in enumerate(zip(got, dims)):
        want = torch.cat([r[i] for r in ranks], dim=d)
        assert torch.equal(g, want) and g.is_contiguous()


class SameShards(fx.Interpreter):
    """Every rank holds the same shard: an all-gather repeats it ``group_size`` times."""

    def call_function(self, target, args, kwargs):
        if target is C.all_gather:
            x, dim, n, _ = args
            return torch.cat([x] * n, dim=dim)
        return super().call_function(target, args, kwargs)


def forward_program():
    graph = fx.Graph()
    w, b, x = (graph.placeholder(n) for n in ("w", "b", "x"))
    gw = graph.call_function(C.all_gather, (w, 0, 4, "dp"))
    gb = graph.call_function(C.all_gather, (b, 0, 4, "dp"))
    mm = graph.call_function(torch.matmul, (x, gw))
    out = graph.call_function(operator.add, (mm, gb))
    graph.output((out, gw))                   # the gathered weight saved for backward
    return fx.GraphModule(torch.nn.Module(), graph), {("mm", 1): [gw], ("add", 1): [gb]}


def test_the_pass_moves_the_gathers_into_a_program_run_once():
    reference, _ = forward_program()
    forward, chains = forward_program()
    gathers = hoist_parameter_gathers(forward, chains, gather_buckets(zero2_plan(), 2),
                                      num_state=2, group_sizes=(4,))
    assert gathers is not None
    assert not any(n.target is C.all_gather for n in forward.graph.nodes)
    targets = [n.target for n in gathers.graph.nodes]
    assert targets.count(C.all_gather) == 1 and flatten_concat in targets    # one bucket
    assert [n.name for n in forward.graph.nodes if n.op == "placeholder"][:3] == ["w", "b", "x"]
    w, b, x = torch.randn(2, 8), torch.randn(2), torch.randn(3, 8)
    copies = SameShards(gathers).run(w, b)
    got = SameShards(forward).run(w, b, x, *copies)
    want = SameShards(reference).run(w, b, x)
    assert all(torch.equal(g, h) for g, h in zip(got, want))


def test_no_hoisted_reads_leave_the_forward_as_it_is():
    forward, _ = forward_program()
    code = forward.code
    assert hoist_parameter_gathers(forward, {}, (), num_state=2, group_sizes=(4,)) is None
    assert forward.code == code
