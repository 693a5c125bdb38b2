"""The memory model's liveness: when values are allocated and freed."""

from __future__ import annotations

from torchalpa.core.opgraph import GraphOutputs, OpGraph, OpNode, TensorSpec, ValueRef
from torchalpa.core.placement import Replicate
from torchalpa.passes.pricing.memory import activation_timeline, liveness, same_layout_views

SPEC = TensorSpec((4, 4))   # 64 bytes


def op(name, *operands, aliases=False):
    return OpNode(name=name, op="aten.view.default" if aliases else "aten.relu.default",
                  operands=tuple(ValueRef(o) for o in operands), outputs=(SPEC,),
                  aliases=aliases)


def graph():
    nodes = [
        OpNode(name="x", op="input", kind="input", outputs=(SPEC,), target="input0"),
        OpNode(name="w", op="param", kind="param", outputs=(SPEC,), target="w",
               is_param=True),
        op("a", "x"),                      # 2
        op("a_view", "a", aliases=True),   # 3: shares a's storage
        op("a_view2", "a_view", aliases=True),
        op("w_t", "w", aliases=True),      # 5: a weight read through a view
        op("b", "x"),                      # 6
        op("c", "a_view2", "w_t"),         # 7: the last reader of both views
    ]
    return OpGraph(nodes, GraphOutputs(loss=ValueRef("c")))


def test_a_view_of_an_activation_keeps_its_storage_alive_and_adds_none():
    live = liveness(graph())
    intervals = {n: (int(s), int(e)) for n, s, e in zip(live.names, live.start, live.end)}
    assert "a_view" not in intervals and "a_view2" not in intervals
    assert intervals["a"] == (2, 7)          # until c reads it through two views
    assert intervals["w_t"] == (5, 7)        # a parameter's view is a copy of its own


def test_timeline_counts_the_viewed_storage_once():
    g = graph()
    outputs = {n.name: (((Replicate(),),)) for n in g}
    timeline = activation_timeline(g, liveness(g), outputs, (1,))
    # at b (6): x, a (seen through its views), w_t and b itself; never a_view or a_view2
    assert timeline[6] == 4 * 64
    assert timeline.max() == 4 * 64


def test_micro_batches_in_flight_hold_what_forward_saved():
    """A pipeline stage with 3 micro-batches in flight: one at any point of its step, two
    waiting for backward with what was alive where forward ended."""
    from dataclasses import replace

    from torchalpa.passes.pricing.memory import MemoryModel, forward_end
    from torchalpa.passes.sharding.simplify import group_nodes
    from torchalpa.passes.sharding.strategies import Strategy
    g = graph()
    g = OpGraph([replace(n, phase="backward") if n.name in ("b", "c") else n for n in g],
                g.outputs)
    R = (Replicate(),)
    S = {n.name: [Strategy(inputs=(R,) * len(n.operands), outputs=(R,))] for n in g}
    one = MemoryModel(g, S, group_nodes(g, S), (1,), 0)
    three = MemoryModel(g, S, group_nodes(g, S), (1,), 0, in_flight=3)
    outputs = {k: s[0].outputs for k, s in S.items()}
    base = activation_timeline(g, liveness(g), outputs, (1,))
    end = forward_end(g)
    assert end == 5 and base[end] == 3 * 64           # x, a, w_t
    assert list(three.timeline(outputs, 0)) == list(base + 2 * base[end])
    assert list(one.timeline(outputs, 0)) == list(base)
    # the ILP's memory rows say the same at every point, plus the model state (w: 64
    # bytes), w_t reading w in w's own layout: no copy, nothing allocated (as the estimate
    # counts it: ``same_layout_views``)
    free = same_layout_views(g, {"w": R}, {k: s[0].inputs for k, s in S.items()})
    assert free == {"w_t"}
    exact = three.timeline(outputs, 64, free_views=free)
    assert exact[6] == 64 + base[6] + 2 * base[end] - 3 * 64     # w_t: here and waiting
    for t in range(len(base)):
        assert sum(v[0] for v in three.terms_at(t).values()) == exact[t]
        assert three.rows_bytes(t, {k: s[0] for k, s in S.items()}) == [exact[t]]


def test_a_parameter_gathered_once_per_step_holds_its_copy_from_the_start():
    """With micro-batches a one-stage step gathers parameters before its first forward
    (runtime/rewrites/param_gather.py): a forward view of a weight is alive from point 0."""
    live = liveness(graph(), state_at_start=True)
    intervals = {n: (int(s), int(e)) for n, s, e in zip(live.names, live.start, live.end)}
    assert intervals["w_t"] == (0, 7)
    assert intervals["a"] == (2, 7)          # activations are unchanged


def test_a_gradient_is_held_from_its_backward_op_with_one_micro_batch_only():
    """A step of one micro-batch makes each gradient in backward and the optimizer reads it
    at the end: it is alive from its op on (an entry named by the parameter, in its
    layout), not for the whole step; with gradient accumulation it is model state, summed
    across micro-batches. Plans count it so, and the ILP's memory model agrees."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import torchalpa
    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.pricing.memory import (
        activation_peak_bytes,
        model_state_bytes,
        state_copies,
    )
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        batch = (torch.empty(16, 64), torch.empty(16, 64))
    g = capture(model, batch, F.mse_loss).graph
    order = {n.name: i for i, n in enumerate(g)}
    live = liveness(g, grads_from_backward=True)
    params = {n.name for n in g if n.kind == "param"}
    grads = dict(g.outputs.grads)
    heads = {head for _, head in live.kept_of.values()}   # a kept bucket's, before its op
    assert heads
    for i, (name, start, end) in enumerate(zip(live.names, live.start, live.end)):
        if name in params and i not in heads:
            assert start == order[grads[g.node(name).target].node] and end == len(g)
    assert {n for n in live.names if n in params} == params
    param_bytes = sum(g.node(p).output.nbytes for p in params)
    R = {n.name: (Replicate(),) for n in g if n.is_leaf}
    assert model_state_bytes(g, R, (1,), 2) - model_state_bytes(g, R, (1,), 2, True) == \
        param_bytes
    assert all(state_copies(g, p, 2, True) == 3 for p in params)
    cluster = torchalpa.Cluster.local_cpu(1)
    plans = {k: torchalpa.plan(model, batch, F.mse_loss, cluster=cluster,
                               method=torchalpa.ShardParallel(num_micro_batches=k)).estimates
             for k in (1, 2)}
    # Adam: parameters and two states held all step; the gradients too with 2 micro-batches
    assert plans[1].model_state_bytes_per_device == 3 * param_bytes
    assert plans[2].model_state_bytes_per_device == 4 * param_bytes
    # the activation peak (where backward starts) holds no gradient yet: the step's peak
    # is below parameters + gradients + states + the activations' peak
    whole = {n.name: ((Replicate(),),) * len(n.outputs) for n in g}
    activations = activation_peak_bytes(g, whole, (1,))[0]
    assert plans[1].memory_per_device_bytes < 4 * param_bytes + activations
    # the step's end (its optimizer step, ``step_end.py``): parameters, states, the
    # gradients and Adam's foreach temporaries (tensors this small: one copy of each)
    assert plans[1].end_of_step_bytes_per_device == plans[2].end_of_step_bytes_per_device \
        == 5 * param_bytes
    assert plans[2].memory_per_device_bytes == max(
        4 * param_bytes + plans[2].activation_bytes_per_device, 5 * param_bytes)


def test_parameters_offloaded_hold_no_state_and_no_summed_gradient_on_the_devices():
    """With parameters offloaded (``PARAMETERS_OFFLOADED``) a device holds neither the
    parameters nor the gradients summed over micro-batches: the state is 0 bytes, never
    less, whatever layout the ops making the gradients give them (here split, a quarter
    of their parameters' replicated bytes, which once came out negative)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from torchalpa.core.options import PARAMETERS_OFFLOADED
    from torchalpa.core.placement import Shard
    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.pricing.memory import accumulated_gradients, model_state_bytes
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        batch = (torch.empty(16, 64), torch.empty(16, 64))
    g = capture(model, batch, F.mse_loss).graph
    R = {n.name: (Replicate(),) for n in g if n.is_leaf}
    raw = accumulated_gradients(g)
    assert raw      # the case: gradients made by ops, summed as those ops lay them out
    outputs = {ref.node: tuple((Shard(0),) for _ in g.node(ref.node).outputs)
               for ref in raw.values()}
    assert model_state_bytes(g, R, (4,), 2, False, outputs) > 0
    buffers = sum(n.output.nbytes for n in g if n.kind == "buffer")
    assert model_state_bytes(g, R, (4,), PARAMETERS_OFFLOADED, False, outputs) == buffers
    assert model_state_bytes(g, R, (4,), PARAMETERS_OFFLOADED) == buffers
