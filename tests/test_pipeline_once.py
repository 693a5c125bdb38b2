"""A pipeline pays what a stage runs once per step (its gradients' final reduction, the
optimizer) once, after the stage's last backward, not once per micro-batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import AutoLayerOption, ManualStageOption, PipeshardParallel
from torchalpa.core.plan_records import Estimates
from torchalpa.frontends.torch_export import capture
from torchalpa.passes.pipeline_search.inter_op import micro_batch_seconds, plan_pipeline


def _plan(graph, cluster, micro_batches: int, marked: bool = False, option=None):
    option = option or torchalpa.AutoShardingOption(force_batch_dim_to_mesh_dim=0)
    return plan_pipeline(graph, cluster, PipeshardParallel(
        num_micro_batches=micro_batches, layer_option=AutoLayerOption(
            layer_num="auto" if marked else 2),
        stage_option=ManualStageOption(forward_stage_layer_ids=[[0], [1]],
                                       submesh_shapes=[(1, 2), (1, 2)],
                                       logical_shapes=[(2,), (2,)], options=[option] * 2)))


def test_gradient_sync_and_optimizer_are_paid_once_per_pipeline_step():
    w = zoo.tiny("gpt", 4, num_layers=2, hidden=64, vocab_size=256)
    with torch.device("meta"):
        model, batch = w.build(), w.example_inputs()
    graph = capture(model, batch, w.loss_fn).graph
    cluster = torchalpa.Cluster.preset("h100", 1, 4)
    few, many = _plan(graph, cluster, 2), _plan(graph, cluster, 6)
    for plan in (few, many):
        once = [s.plan.estimates.once_per_step_s for s in plan.stages]
        assert all(o > 0 for o in once)      # data parallel: each stage all-reduces its grads
        # the schedule runs micro-batches without it; each stage pays it after its last one
        assert plan.estimates.stage_step_s == pytest.approx(
            [s.plan.estimates.step_time_s - o for s, o in zip(plan.stages, once)])
        ends = [max(e for *_, e in stage) + o
                for stage, o in zip(plan.estimates.timeline, once)]
        assert plan.estimates.step_time_s >= max(ends) - 1e-12
    # four more micro-batches add four of the slowest stage's micro-batch, nothing else
    slowest = max(many.estimates.stage_step_s)
    added = many.estimates.step_time_s - few.estimates.step_time_s
    assert added == pytest.approx(4 * slowest, rel=1e-6)
    with_once = max(s.plan.estimates.step_time_s for s in many.stages)
    assert added < 4 * with_once - 3 * min(s.plan.estimates.once_per_step_s
                                           for s in many.stages)


def test_a_stage_costs_the_search_its_share_of_the_once_per_step_work():
    e = Estimates(step_time_s=1.0, once_per_step_s=0.4)
    assert micro_batch_seconds(e, 4) == pytest.approx(0.6 + 0.1)
    assert micro_batch_seconds(Estimates(step_time_s=1.0), 4) == 1.0


def _half_precision_gpt(half: bool = True):
    """A 2-block GPT whose blocks compute in float16 from float32 master weights (each
    weight cast where its block reads it; all in float32 if not ``half``), cut after its
    first block."""
    from torchalpa.runtime.execution.precision import CastForward
    w = zoo.tiny("gpt", 8, num_layers=2, hidden=1024, vocab_size=512)
    with torch.device("meta"):
        model, batch = w.build(), w.example_inputs()
    for i, block in enumerate(model.h if half else ()):
        model.h[i] = CastForward(block, torchalpa.MixedPrecision(param_dtype=torch.float16,
                                                                 output_dtype=None))
    model.h[0].register_forward_hook(lambda m, i, o: torchalpa.mark_pipeline_boundary(o))
    return capture(model, batch, w.loss_fn).graph


def _per_micro_batch_all_reduce_bytes(stage_plan) -> int:
    """Bytes a stage all-reduces with every micro-batch (not its gradients' final
    reductions, which run once per step)."""
    from torchalpa.core.plan import OUTPUT
    return sum(st.bytes for r in stage_plan.reshards if r.consumer != OUTPUT
               for st in r.steps if st.kind == "all_reduce")


def test_a_stage_reduces_its_weight_gradients_once_per_step_not_per_micro_batch():
    # one micro-batch: reducing each float16 weight gradient inside backward (half the
    # bytes of the float32 one it is cast to) is the cheaper plan. 64 micro-batches: the
    # runtime sums the raw gradients and reduces them once after the last backward, so a
    # reduction inside backward would run 64 times; the stage ILP must weigh that
    graph = _half_precision_gpt()
    # the host's time per op left out: this small stage would be host-bound, every plan alike
    cluster = dataclasses.replace(torchalpa.Cluster.preset("h100", 1, 4), host_op_s=0.0)
    one, many = _plan(graph, cluster, 1, True), _plan(graph, cluster, 64, True)
    assert _per_micro_batch_all_reduce_bytes(one.stages[0].plan) > 2 ** 20
    assert _per_micro_batch_all_reduce_bytes(many.stages[0].plan) == 0
    # so the first stage's gradient reduction is paid once per step however many
    # micro-batches run: its seconds per micro-batch are below the one-micro-batch plan's
    per_micro = [s.plan.estimates.step_time_s - s.plan.estimates.once_per_step_s
                 for s in (one.stages[0], many.stages[0])]
    assert per_micro[1] < per_micro[0]


def test_a_tied_gradient_part_is_made_whole_once_per_step_before_it_is_sent():
    # the head's stage sends its part of the tied embedding's gradient to the embedding's
    # stage, which only adds it in: the runtime sums it over the micro-batches and makes
    # the sum whole once (runtime/execution/pipeline.py), so its collectives are priced
    # once per step, not with every micro-batch
    from torchalpa.core.opgraph import OpGraph
    from torchalpa.core.plan import OUTPUT
    from torchalpa.passes.pipeline_search.subgraph import stage_subgraph
    from torchalpa.passes.pricing.cost import collective_cost
    from torchalpa.passes.sharding.intra_op import plan_intra_op
    graph = _half_precision_gpt(half=False)
    plan = _plan(graph, torchalpa.Cluster.preset("h100", 1, 4), 8, True)
    sub = stage_subgraph(graph, plan.node_stage, 1).graph
    summed = sub.meta["summed_sends"]
    assert len(summed) == 1
    mesh = torchalpa.Cluster.preset("h100", 1, 2).logical_mesh((2,))
    option = torchalpa.AutoShardingOption(force_batch_dim_to_mesh_dim=0)
    method = torchalpa.ShardParallel(auto_sharding_option=option)
    planned = plan_intra_op(sub, mesh, method)
    once = planned.estimates
    apart = plan_intra_op(OpGraph(list(sub), sub.outputs, dict(sub.meta, summed_sends=())),
                          mesh, method).estimates
    sent = sum(collective_cost(mesh, st.kind, st.axis, st.bytes) for r in planned.reshards
               if r.consumer == OUTPUT and str(r.slot) in {f"send:{s}" for s in summed}
               for st in r.steps if st.is_collective)
    assert sent > 0
    assert once.once_per_step_s - apart.once_per_step_s == pytest.approx(sent, rel=1e-6)


_ZERO = torchalpa.AutoShardingOption(force_batch_dim_to_mesh_dim=0, parameters="sharded")


def _zero_plan(graph, micro_batches: int):
    """``graph`` in 2 stages of 2 gloo ranks each, parameters sharded (ZeRO-2)."""
    option = _ZERO
    return plan_pipeline(graph, torchalpa.Cluster.local_cpu(4), PipeshardParallel(
        num_micro_batches=micro_batches, layer_option=AutoLayerOption(layer_num=2),
        stage_option=ManualStageOption(forward_stage_layer_ids=[[0], [1]],
                                       submesh_shapes=[(1, 2), (1, 2)],
                                       logical_shapes=[(2,), (2,)], options=[option] * 2)))


def test_a_zero_stage_gathers_its_parameters_once_per_step_not_per_micro_batch():
    # the stage's runtime gathers its sharded parameters before its first micro-batch
    # (runtime/rewrites/param_gather.py, as a one-stage step does): with several
    # micro-batches the gathers are paid once per step, not with each micro-batch; so is
    # the gather of the tied weight stage 0 sends (once per step) to the head's stage
    from torchalpa.core.plan import OUTPUT
    from torchalpa.passes.pipeline_search.subgraph import stage_subgraph
    from torchalpa.passes.pipeline_search.submesh_views import submesh_cluster
    from torchalpa.passes.pipeline_search.view_classes import reprice
    from torchalpa.passes.pricing.cost import steps_cost
    w = zoo.tiny("gpt", 8, num_layers=2, hidden=64, vocab_size=256)
    with torch.device("meta"):
        model, batch = w.build(), w.example_inputs()
    graph = capture(model, batch, w.loss_fn).graph
    cluster = torchalpa.Cluster.local_cpu(4)
    plan = _zero_plan(graph, 4)
    for s in plan.stages:
        mesh = submesh_cluster(cluster, s.submesh).logical_mesh(tuple(s.plan.mesh_shape))
        sub = stage_subgraph(graph, plan.node_stage, s.index).graph
        stage_method = torchalpa.ShardParallel(auto_sharding_option=_ZERO)
        # the same layouts priced as if the stage gathered them with every micro-batch
        per_micro = reprice(sub, s.plan, mesh, stage_method, step_micro_batches=1)
        once = reprice(sub, s.plan, mesh, stage_method, step_micro_batches=4)
        assert per_micro is not None and once is not None
        # as the pipeline priced its stage
        assert (once.estimates.step_time_s, once.estimates.once_per_step_s) == pytest.approx(
            (s.plan.estimates.step_time_s, s.plan.estimates.once_per_step_s), rel=1e-9)
        params = {p.node for p in s.plan.parameters}
        # its forward reads of parameters, and (stage 0) the tied weight it sends
        gathers = [st for r in s.plan.reshards if r.producer in params
                   and (r.slot.kind == "send" if r.consumer == OUTPUT
                        else sub.node(r.consumer).phase == "forward")
                   for st in r.steps if st.kind == "all_gather"]
        sent = [r for r in s.plan.reshards if r.consumer == OUTPUT and r.producer in params
                and r.slot.kind == "send" and r.steps]
        assert gathers and len(sent) == (1 if s.index == 0 else 0)
        g = steps_cost(mesh, gathers)
        ea, eb = per_micro.estimates, once.estimates
        # per micro-batch: the gathers left; once per step: the gathers added
        assert eb.step_time_s - eb.once_per_step_s == pytest.approx(
            ea.step_time_s - ea.once_per_step_s - g, rel=1e-9)
        assert eb.once_per_step_s == pytest.approx(ea.once_per_step_s + g, rel=1e-9)


def _cast_tied_gpt():
    """A 2-block GPT cast per module to float16 (mixed precision: the tied embedding is
    cast in the first stage and again in the head's), cut after its first block."""
    from torchalpa.runtime.execution.precision import CastForward
    w = zoo.tiny("gpt", 8, num_layers=2, hidden=64, vocab_size=256)
    with torch.device("meta"):
        model, batch = w.build(), w.example_inputs()
    policy = torchalpa.MixedPrecision(param_dtype=torch.float16, output_dtype=None)
    for i, block in enumerate(model.h):
        model.h[i] = CastForward(block, policy)
    for name in ("wte", "wpe", "ln_f", "lm_head"):
        setattr(model, name, CastForward(getattr(model, name), policy))
    model.h[0].register_forward_hook(lambda m, i, o: torchalpa.mark_pipeline_boundary(o))
    return capture(model, batch, w.loss_fn).graph


def test_a_cast_tied_gradient_part_is_not_reduced_with_every_micro_batch():
    # mixed precision cast per module: the head's stage casts the tied embedding again, so
    # its gradient part is narrow (float16) inside backward and float32 as it is sent back.
    # Sent summed, once per step, it is made whole once (float32); the stage's ILP prices
    # that send once too, so it no longer reduces the narrow part with every micro-batch
    # (half the bytes, 8 times a step)
    plan = _plan(_cast_tied_gpt(), torchalpa.Cluster.local_cpu(4), 8, True)
    summed = [t for t in plan.transfers if t.once_per_step and t.phase == "backward"]
    assert len(summed) == 1 and summed[0].bytes == 256 * 64 * 4
    head = plan.stages[summed[0].src_stage].plan
    # only the loss's scalars are all-reduced per micro-batch
    assert _per_micro_batch_all_reduce_bytes(head) < 64


def test_the_embedding_stage_adds_the_received_gradient_part_to_a_partial_sum():
    # the embedding's stage adds the summed part it receives (whole) to its own part of the
    # tied gradient, a partial sum over the data-parallel axis. Solved simplified (as a
    # stage too large for the unsimplified re-solves is: BLOOM-176B's first stage), that
    # add followed its operand reduced, as a bias add does: an all-reduce of the own part
    # with every micro-batch (8 a step, 32 KiB each), where the gradient is reduced once
    # per step anyway. It keeps the partial sum now; the received part is split into one.
    # (What is left per micro-batch, 2 KiB, is the position embedding's gradient summed
    # over the batch: the same simplification, an operand of its embedding_dense_backward)
    option = torchalpa.AutoShardingOption(force_batch_dim_to_mesh_dim=0,
                                          free_followers_below=0, exact_below=0)
    plan = _plan(_cast_tied_gpt(), torchalpa.Cluster.local_cpu(4), 8, True, option)
    summed, = [t for t in plan.transfers if t.once_per_step and t.phase == "backward"]
    embedding = plan.stages[summed.dst_stage].plan
    assert _per_micro_batch_all_reduce_bytes(embedding) < 256 * 64 * 2 / 8
    # reduced once per step, as the parameter's gradient
    from torchalpa.core.plan import OUTPUT
    assert any(st.kind == "all_reduce" and st.bytes == 256 * 64 * 4
               for r in embedding.reshards if r.consumer == OUTPUT
               and r.slot.kind == "grad" and r.slot.name == "wte.weight" for st in r.steps)


def test_a_summed_gradient_part_is_not_held_by_the_micro_batches_in_flight():
    # the part of the tied gradient the head's stage sends summed arrives after the
    # embedding stage's last backward (StageExchange.finish): no micro-batch in flight
    # holds it. Counted from the step's start it was alive where forward ends, so once
    # for every micro-batch in flight: BLOOM-176B's first stage (12 in flight) found no
    # plan within its budget with that part kept a partial sum (3.35 GiB a device, x 12)
    from torchalpa.core.opgraph import ValueRef
    from torchalpa.passes.pipeline_search.subgraph import received_name, stage_subgraph
    from torchalpa.passes.pricing.memory import forward_end, liveness
    graph = _cast_tied_gpt()
    plan = _plan(graph, torchalpa.Cluster.local_cpu(4), 8, True)
    summed, = [t for t in plan.transfers if t.once_per_step and t.phase == "backward"]
    sub = stage_subgraph(graph, plan.node_stage, summed.dst_stage).graph
    name = received_name(ValueRef(summed.producer, summed.index))
    live = liveness(sub)
    i = live.names.index(name)
    add, = sub.consumers(name)
    order = [n.name for n in sub]
    assert live.start[i] == order.index(add) > forward_end(sub)


def test_a_gradient_received_per_micro_batch_arrives_when_its_backward_runs():
    # a stage receives the gradient of what it sent right before that micro-batch's
    # backward (StepRunner._backward): the micro-batches waiting for backward hold none.
    # Counted from the step's start it was alive where forward ends, so once more for
    # every micro-batch in flight
    from torchalpa.core.opgraph import ValueRef
    from torchalpa.passes.pipeline_search.subgraph import received_name, stage_subgraph
    from torchalpa.passes.pricing.memory import forward_end, liveness
    graph = _cast_tied_gpt()
    plan = _plan(graph, torchalpa.Cluster.local_cpu(4), 8, True)
    per_micro = [t for t in plan.transfers if t.phase == "backward" and not t.once_per_step]
    assert per_micro
    t = per_micro[0]
    sub = stage_subgraph(graph, plan.node_stage, t.dst_stage).graph
    name = received_name(ValueRef(t.producer, t.index))
    live = liveness(sub)
    i = live.names.index(name)
    end = forward_end(sub)
    assert live.start[i] == end + 1 and live.end[i] > end
    assert i not in live.alive(end)


def test_a_stage_drops_a_micro_batchs_sends_once_its_gradient_comes_back(monkeypatch):
    # a pending send holds its tensor until waited for; waited for only at the step's end,
    # every micro-batch's sent activations stayed alive to it (all 128 on BLOOM-176B's
    # stages) where the memory model holds those of the micro-batches in flight. Once the
    # next stage sends back micro-batch m's gradient it has received m's activations: the
    # sends up to m are waited for (without blocking) and dropped; its gradients sent back
    # are waited for two micro-batches later
    from types import SimpleNamespace

    import torch.distributed as dist

    from torchalpa.runtime.execution.pipeline import StageExchange

    class Work:
        def __init__(self, log, what):
            self.log, self.what = log, what

        def wait(self):
            self.log.append(self.what)
            return True

    waited: list = []
    monkeypatch.setattr(dist, "isend", lambda t, peer, tag: Work(waited, ("send", tag % 100_003)))
    monkeypatch.setattr(dist, "irecv", lambda t, peer, tag: Work([], None))
    T = SimpleNamespace
    transfers = [T(producer="h", index=0, src_stage=0, dst_stage=1, phase="forward",
                   once_per_step=False, split=1, batch_split=1),
                 T(producer="g", index=0, src_stage=1, dst_stage=0, phase="backward",
                   once_per_step=False, split=1, batch_split=1)]
    pplan = T(transfers=transfers, stages=[T(ranks=[0], plan=T(mesh_shape=(1,))),
                                           T(ranks=[1], plan=T(mesh_shape=(1,)))])
    ex = StageExchange(pplan, 0, 0, {("g", 0): ((2,), torch.float32)}, torch.device("cpu"))
    for m in range(4):
        ex.send(("h", 0), torch.ones(2), m)
    assert len(ex._pending) == 4 and not waited
    ex.recv(("g", 0), 1)
    assert waited == [("send", 0), ("send", 1)] and len(ex._pending) == 2
    # the earlier stage's side: its gradients wait two micro-batches
    waited.clear()
    back = StageExchange(pplan, 1, 1, {("h", 0): ((2,), torch.float32)}, torch.device("cpu"))
    for m in range(5):
        back.send(("g", 0), torch.ones(2), m)
    assert waited == [("send", 0), ("send", 1), ("send", 2)] and len(back._pending) == 2
