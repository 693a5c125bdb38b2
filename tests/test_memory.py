"""The memory model's liveness: when values are allocated and freed."""

from __future__ import annotations

from torchalpa.core.opgraph import GraphOutputs, OpGraph, OpNode, TensorSpec, ValueRef
from torchalpa.core.placement import Replicate
from torchalpa.passes.pricing.memory import activation_timeline, liveness

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
    # the ILP's memory rows say the same at every point, plus the model state (w: 64 bytes)
    for t in range(len(base)):
        assert sum(v[0] for v in three.terms_at(t).values()) == 64 + base[t] + 2 * base[end]


def test_a_parameter_gathered_once_per_step_holds_its_copy_from_the_start():
    """With micro-batches a one-stage step gathers parameters before its first forward
    (runtime/rewrites/param_gather.py): a forward view of a weight is alive from point 0."""
    live = liveness(graph(), state_at_start=True)
    intervals = {n: (int(s), int(e)) for n, s, e in zip(live.names, live.start, live.end)}
    assert intervals["w_t"] == (0, 7)
    assert intervals["a"] == (2, 7)          # activations are unchanged
