"""The memory model's liveness: when values are allocated and freed."""

from __future__ import annotations

from torchalpa.opgraph import GraphOutputs, OpGraph, OpNode, TensorSpec, ValueRef
from torchalpa.passes.memory import activation_timeline, liveness
from torchalpa.placement import Replicate

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
