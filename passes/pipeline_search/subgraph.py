"""A pipeline stage's own graph: the ops of a range of layers, forward and backward.

Values the stage reads but another stage makes (activations from earlier stages in
forward, gradients from later stages in backward, a tied weight owned elsewhere) become
leaves it *receives* (kind ``input``: they arrive whole and may be sliced for free). Values
it makes that another stage reads are its *sends* (it produces them whole). Those of them
whose dim 0 is the batch, crossing every micro-batch, are listed in the graph's
``meta["batch_split"]`` (sends by ``str(ref)``, receives by leaf name): they may cross
with the batch split over the mesh's first axis instead (``passes/sharding/
stage_boundary.py``), where the pipeline's assembly keeps them listed. User inputs
are readable by every stage (every rank has the batch). A received value whose dim 0 is
not the batch (a tied weight owned elsewhere, its cast, its gradient) is marked
``batched=False``, so data parallelism does not try to split it as if it were a batch. The loss belongs to the stage
that computes it; a parameter's gradient and a buffer's update to the stage that owns
the parameter or buffer (received there if computed elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchalpa.core.opgraph import GraphOutputs, OpGraph, OpNode, ValueRef

__all__ = ["StageGraph", "stage_subgraph", "received_name", "once_per_step"]


@dataclass
class StageGraph:
    graph: OpGraph
    receives: dict[str, ValueRef]   # leaf name in the stage graph -> value in the full graph
    sends: list[ValueRef]           # values of the full graph other stages read


def received_name(ref: ValueRef) -> str:
    return f"recv_{ref.node}_{ref.index}"


def stage_subgraph(graph: OpGraph, stage_of: dict[str, int], stage: int) -> StageGraph:
    """The graph of one stage, given every node's stage."""
    inside = {n.name for n in graph if stage_of[n.name] == stage and n.kind != "input"}
    user_inputs = {n.name for n in graph if n.kind == "input"}
    receives: dict[str, ValueRef] = {}
    body: list[OpNode] = []

    def local(ref: ValueRef) -> ValueRef:
        if ref.node in inside or ref.node in user_inputs:
            return ref
        name = received_name(ref)
        if name not in receives:
            receives[name] = ref
        return ValueRef(name)

    for node in graph:
        if node.name in inside and not node.is_leaf:
            body.append(_with_operands(node, tuple(local(r) for r in node.operands)))
        elif node.name in inside:
            body.append(node)
    out = graph.outputs
    loss = local(out.loss) if out.loss is not None and stage_of[out.loss.node] == stage else None
    params = graph.params
    buffers = {n.target: n.name for n in graph if n.kind == "buffer"}
    grads = tuple((fqn, local(ref)) for fqn, ref in out.grads if params[fqn] in inside)
    updates = tuple((fqn, local(ref)) for fqn, ref in out.buffer_updates
                    if buffers[fqn] in inside)
    sends = _sends(graph, stage_of, stage, inside)
    used = {r.node for n in body for r in n.operands} | {r.node for r in
                                                         [loss] if r is not None}
    used |= {r.node for _, r in grads + updates}
    leaves = [n for n in graph if n.name in user_inputs and n.name in used]
    batched = _batch_first(graph) if receives or sends else set()
    received = [OpNode(name=name, op="input", kind="input",
                       outputs=(graph.spec(ref),), target=f"stage_input:{ref}",
                       phase=graph.node(ref.node).phase, source=ref.node,
                       batched=ref in batched)
                for name, ref in receives.items()]
    nodes = leaves + received + body
    summed = _summed_sends(graph, stage_of, stage, sends)
    # batch-first values crossing every micro-batch may cross batch-split (as sent, as
    # received: passes/sharding/stage_boundary.py)
    split = frozenset(str(ref) for ref in sends if ref in batched and str(ref) not in summed
                      and graph.node(ref.node).kind != "param") | \
        frozenset(n.name for n in received if n.batched)
    sub = OpGraph(nodes, GraphOutputs(loss=loss, grads=grads, buffer_updates=updates,
                                      sends=tuple(sends)),
                  meta=dict(graph.meta, stage=stage, summed_sends=summed, batch_split=split))
    return StageGraph(sub, receives, sends)


def _batch_first(graph: OpGraph) -> set[ValueRef]:
    """Values whose dim 0 carries the batch (``constraints.batch_dims``): not a parameter,
    its cast, or a weight gradient (whose batch was contracted)."""
    from torchalpa.passes.sharding.constraints import batch_dims
    return {ValueRef(node, index) for (node, index), dims in batch_dims(graph).items()
            if 0 in dims}


def _with_operands(node: OpNode, operands: tuple[ValueRef, ...]) -> OpNode:
    from dataclasses import replace
    return replace(node, operands=operands)


def once_per_step(graph: OpGraph, ref: ValueRef, part: dict, dst: int) -> bool:
    """Whether ``ref`` can cross to stage (or layer) ``dst`` of ``part`` once per step
    instead of per micro-batch: a parameter, or a gradient part ``dst`` only adds into a
    parameter's gradient (GPT's head contributing to its tied embedding's gradient),
    which may be summed over the micro-batches first."""
    if graph.node(ref.node).kind == "param":
        return True
    if graph.node(ref.node).phase != "backward":
        return False
    readers = [c for c in graph.consumers(ref.node) if part[c] == dst]
    if len(readers) != 1:
        return False
    add = graph.node(readers[0])
    return (add.op == "aten.add.Tensor" and len(add.operands) == 2
            and sum(1 for o in add.operands if o == ref) == 1
            and not graph.consumers(add.name)
            and any(r == ValueRef(add.name, 0) for _, r in graph.outputs.grads))


def _summed_sends(graph: OpGraph, stage_of: dict[str, int], stage: int,
                  sends: list[ValueRef]) -> frozenset[str]:
    """The sends (as ``ValueRef`` strings) every reader stage only adds into a parameter's
    gradient: summed over the micro-batches and made whole once per step, after the last
    backward (``stage_transfers.once_per_step``; ``runtime/execution/pipeline.py``)."""
    out = set()
    for ref in sends:
        readers = {stage_of[c] for c in graph.consumers(ref.node)} - {stage}
        if graph.node(ref.node).kind != "param" and readers and all(
                once_per_step(graph, ref, stage_of, t) for t in readers):
            out.add(str(ref))
    return frozenset(out)


def _sends(graph: OpGraph, stage_of: dict[str, int], stage: int, inside: set[str]
           ) -> list[ValueRef]:
    """Values made here that another stage reads (as an operand or as one of its outputs)."""
    wanted: dict[ValueRef, None] = {}
    for node in graph:
        if node.is_leaf or stage_of[node.name] == stage:
            continue
        for ref in node.operands:
            if ref.node in inside:
                wanted[ref] = None
    params = graph.params
    buffers = {n.target: n.name for n in graph if n.kind == "buffer"}
    owner = [(params[f], r) for f, r in graph.outputs.grads] + \
        [(buffers[f], r) for f, r in graph.outputs.buffer_updates]
    for leaf, ref in owner:
        if ref.node in inside and stage_of[leaf] != stage:
            wanted[ref] = None
    return list(wanted)
