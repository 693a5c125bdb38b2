"""The ILP's memory rows against the plan's estimate (passes/pricing/memory.py,
``MemoryModel``; passes/pricing/step_end.py): for a solved plan, what each row counts is
what the estimate counts at that point -- the optimizer step's rows read the same
``StepEnd`` as ``Estimates.end_of_step_bytes_per_device``, views of parameters read in
their own layout are free in both, and a reduced gradient is one buffer with its raw sum
where the two are the same memory. Rows above the estimate would refuse plans that fit."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
import torchalpa.passes.sharding.intra_op as intra_op
from torchalpa.passes.pricing.step_end import device_type_of, end_of_step_bytes


def _mlp(width: int) -> tuple[nn.Module, tuple]:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(),
                              nn.Linear(4 * width, width), nn.ReLU(), nn.Linear(width, width))
        batch = (torch.empty(4, width), torch.empty(4, width))
    return model, batch


def _solves(monkeypatch, model, batch, method, devices: int):
    """The plan, and every (memory model, chosen strategies) its ILP solves returned."""
    seen = []
    solve = intra_op._solve_within_memory

    def recording(graph, S, grouping, cg, memory, budget, option, mesh, *args, **kwargs):
        solution, chosen = solve(graph, S, grouping, cg, memory, budget, option, mesh,
                                 *args, **kwargs)
        seen.append((graph, memory, chosen, mesh))
        return solution, chosen

    monkeypatch.setattr(intra_op, "_solve_within_memory", recording)
    plan = torchalpa.plan(model, batch, F.mse_loss, method=method,
                          cluster=torchalpa.Cluster.local_cpu(devices))
    return plan, seen



def _rows_follow_the_timeline(graph, memory, chosen, mesh):
    """Assert that each row before the optimizer step is the exact timeline's bytes there;
    the timeline, the leaves' chosen layouts and the optimizer step's end-of-step bytes."""
    timeline = intra_op._timeline(graph, memory, chosen, mesh, memory.optimizer_states)
    for t in range(memory.end):
        assert memory.rows_bytes(t, chosen) == [pytest.approx(timeline[t])], t
    leaves = {k: s.outputs[0] for k, s in chosen.items() if graph.node(k).is_leaf}
    end = end_of_step_bytes(graph, leaves, mesh.shape, memory.optimizer,
                            memory.optimizer_states, device_type_of(mesh.backend))
    return timeline, leaves, end

METHODS = {
    "dp": (torchalpa.DataParallel, 2),
    "zero2": (torchalpa.Zero2Parallel, 2),
    "zero3": (torchalpa.Zero3Parallel, 4),
    "tp": (lambda: torchalpa.ShardParallel(auto_sharding_option=torchalpa.AutoShardingOption(
        force_batch_dim_to_mesh_dim=None)), 4),
}


@pytest.mark.parametrize("width", [32, 512])
@pytest.mark.parametrize("name", list(METHODS))
def test_the_rows_of_a_solved_plan_count_what_its_estimate_counts(monkeypatch, name, width):
    """Width 32: Adam steps with ``foreach`` (one term per parameter); 512: tensor by
    tensor on CPU (the largest block's copies, one row per parameter). At the optimizer
    step the largest row is the estimate's end of step, and at every other point each
    row is the exact timeline the estimate takes its peak from."""
    method, devices = METHODS[name]
    plan, seen = _solves(monkeypatch, *_mlp(width), method(), devices)
    assert seen
    ends = []
    for graph, memory, chosen, mesh in seen:
        timeline, leaves, end = _rows_follow_the_timeline(graph, memory, chosen, mesh)
        assert end == timeline[-1] > 0
        assert max(memory.rows_bytes(memory.end, chosen)) == pytest.approx(end)
        ends.append(end)
    assert plan.estimates.end_of_step_bytes_per_device in ends


@pytest.mark.parametrize("name", ["dp", "zero2"])
def test_the_rows_of_a_step_summing_micro_batches_count_the_sums_reduction(monkeypatch, name):
    """Two micro-batches: the gradients are summed and reduced after the last backward,
    bucket by bucket (``passes/pricing/sum_reduction.py``). The point after backward is
    the larger of that reduction (the sums beside the reduced gradients, and under ZeRO-2
    the largest bucket packed beside its members) and the optimizer step, in the rows as in
    the estimate; the 8-layer MLP's 3-member buckets make the reduction the larger under
    both plans at width 512. Under ZeRO-2 the parameters' gather before the first
    micro-batch is larger still (the next test); the step's end is the largest of the
    three."""
    from torchalpa.passes.pricing.sum_reduction import sum_reduction_bytes
    method, devices = METHODS[name]
    plan, seen = _solves(monkeypatch, *_narrow_mlp(), method(num_micro_batches=2), devices)
    assert seen
    for graph, memory, chosen, mesh in seen:
        assert not memory.grads_from_backward
        timeline, leaves, update = _rows_follow_the_timeline(graph, memory, chosen, mesh)
        reduction = sum_reduction_bytes(graph, leaves, {k: s.outputs for k, s in chosen.items()},
                                        mesh.shape, memory.optimizer_states)
        assert reduction > update > 0
        end = max(reduction, _gather(graph, memory, chosen, mesh))
        assert timeline[-1] == end
        assert max(memory.rows_bytes(memory.end, chosen)) == pytest.approx(end)
    assert plan.estimates.end_of_step_bytes_per_device == pytest.approx(end)


def _narrow_mlp(batch: int = 4) -> tuple[nn.Module, tuple]:
    """8 layers of width 512 (Linear 512 -> 2048, 2048 -> 512, a ReLU after each): 33.6 MB
    of weights, one bucket of ZeRO-2's blocks on 2 devices; a global batch of ``batch``."""
    with torch.device("meta"):
        layers: list[nn.Module] = []
        for i in range(8):
            layers += [nn.Linear(512, 2048) if i % 2 == 0 else nn.Linear(2048, 512), nn.ReLU()]
        return nn.Sequential(*layers), (torch.empty(batch, 512), torch.empty(batch, 512))


def _gather(graph, memory, chosen, mesh, device_type: str | None = None) -> float:
    """``state_gather_bytes`` of the plan ``chosen`` (``passes/pricing/state_gather.py``)."""
    from torchalpa.passes.pricing.state_gather import state_gather_bytes
    leaves = {k: s.outputs[0] for k, s in chosen.items() if graph.node(k).is_leaf}
    return state_gather_bytes(graph, leaves, {k: s.inputs for k, s in chosen.items()},
                              mesh.shape, memory.optimizer_states,
                              device_type or memory.device_type, memory.bucket_bytes)


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_the_rows_of_a_step_gathering_its_parameters_count_the_gather(monkeypatch,
                                                                      micro_batches):
    """ZeRO-2 with micro-batches gathers the parameters once, before the first micro-batch
    (``runtime/rewrites/param_gather.py``): the narrow MLP's one bucket holds, beside the
    parameters and Adam's states (50.4 MB a device), its packed blocks (16.8 MB), the
    gathered flat buffer and gloo's copy of it (33.6 MB each): 134.4 MB, above the sums'
    reduction (126.0 MB); measured 134.38 MB on 2 gloo ranks (tests/end_of_step_worker.py).
    On NCCL (no copy) the split after the gather, the flat buffer beside the copies made
    from it, is the larger: 117.6 MB. The rows at the step's end and the estimate read it."""
    from torchalpa.passes.pricing.sum_reduction import sum_reduction_bytes
    plan, seen = _solves(monkeypatch, *_narrow_mlp(4 * micro_batches),
                         torchalpa.Zero2Parallel(num_micro_batches=micro_batches), 2)
    assert seen
    weights = sum(p.numel() * 4 for p in _narrow_mlp()[0].parameters())
    for graph, memory, chosen, mesh in seen:
        assert memory.state_at_start
        timeline, leaves, _ = _rows_follow_the_timeline(graph, memory, chosen, mesh)
        held = 3 * weights / 2          # parameters and Adam's two states, halved
        gather = _gather(graph, memory, chosen, mesh)
        assert gather == pytest.approx(held + weights / 2 + 2 * weights)
        assert _gather(graph, memory, chosen, mesh, "cuda") == pytest.approx(held + 2 * weights)
        reduction = sum_reduction_bytes(graph, leaves, {k: s.outputs for k, s in chosen.items()},
                                        mesh.shape, memory.optimizer_states)
        assert gather > reduction
        assert timeline[-1] == gather
        assert max(memory.rows_bytes(memory.end, chosen)) == pytest.approx(gather)
    assert plan.estimates.end_of_step_bytes_per_device == pytest.approx(gather)
    assert plan.estimates.memory_per_device_bytes == pytest.approx(gather)


def test_a_views_gathered_copies_are_the_same_whichever_points_were_asked_first(monkeypatch):
    """``MemoryModel.view_terms`` prices each saved view's layouts once and reuses them at
    every point (a stage ILP asks 8-9): the terms at each point, asked in step order with
    one micro-batch in flight and then in reverse with three, are those a fresh model
    gives when that point and count are asked first. The zoo GPT under tensor parallelism
    with Megatron's styles pinned keeps gathered copies of views backward reads."""
    import copy

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from torchalpa.models import gpt
    from torchalpa.passes.sharding.costgraph import REGATHER_SAVED_VIEWS

    rule = intra_op.forbidden_collectives
    monkeypatch.setattr(intra_op, "forbidden_collectives",
                        lambda option: rule(option) - {REGATHER_SAVED_VIEWS})
    monkeypatch.setenv("TORCHALPA_CACHE", "0")
    config = gpt.GPTConfig(vocab_size=128, max_seq_len=64, num_layers=2, num_heads=4,
                           hidden=64, dropout=0.0)
    with torch.device("meta"):
        model = gpt.GPT(config)
    batch = gpt.example_batch(config, 2, seq_len=64, device="meta")
    styles = {"h.*.attn.c_attn": ColwiseParallel(), "h.*.attn.c_proj": RowwiseParallel(),
              "h.*.mlp.c_fc": ColwiseParallel(), "h.*.mlp.c_proj": RowwiseParallel()}
    seen = []
    solve = intra_op._solve_within_memory

    def recording(graph, S, grouping, cg, memory, *args, **kwargs):
        seen.append(memory)
        return solve(graph, S, grouping, cg, memory, *args, **kwargs)

    monkeypatch.setattr(intra_op, "_solve_within_memory", recording)
    torchalpa.plan(model, batch, gpt.loss_fn, cluster=torchalpa.Cluster.h100(
        devices_per_node=4), method=torchalpa.ShardParallel(
        logical_mesh_shape=(4,), auto_sharding_option=torchalpa.AutoShardingOption(
            sequence_parallel=True, pin=styles)))
    assert seen

    def terms(memory, t, in_flight):
        fresh = copy.copy(memory)
        fresh.in_flight, fresh._view_reads_of = in_flight, {}
        return fresh.view_terms(t)

    def same(a, b) -> bool:
        return [(x.producer, x.copy_from.tolist(), x.pairs[0][0], x.pairs[0][1].tolist(),
                 x.nbytes, x.key) for x in a] == \
            [(x.producer, x.copy_from.tolist(), x.pairs[0][0], x.pairs[0][1].tolist(),
              x.nbytes, x.key) for x in b]

    found = 0
    for memory in seen:
        points = list(range(memory.end))
        for in_flight, order in ((1, points), (3, points[::-1])):
            memory.in_flight = in_flight
            for t in order:
                asked = memory.view_terms(t)
                assert same(asked, terms(memory, t, in_flight)), (t, in_flight)
                found += len(asked)
    assert found > 0       # some point of some solve keeps a gathered copy
