"""Layers: contiguous groups of ops, the unit pipeline stages are made of.

Forward ops are cut into layers either where the model says
(``torchalpa.mark_pipeline_boundary()``) or by Alpa's layer-construction DP: ``L`` layers,
each with between ``(1 - eps)`` and ``(1 + eps)`` times the average forward flops (without
the lower bound, cuts drift to the nearly free positions inside the loss and leave
layers without work), minimizing the bytes of
activations alive across the cuts (what a pipeline has to send between stages); ties go
to the most balanced cuts. A cut's cost is separable, so the DP keeps, for each cut
position, the cheapest way to reach it, and a sliding-window minimum makes it O(L x ops).

Everything else follows the forward ops: parameters join the layer of their first
reader (so do forward ops computed from parameters alone, such as mixed precision's
casts, which forward's order puts first), inputs the layer of theirs, and each backward
op the layer of the forward ops of its module (autograd tags it with them); ops autograd
adds without a module join their operands' layer. A backward op never sits in a later
layer than a backward op it reads: gradients must flow from later stages to earlier ones
for a pipeline to run.
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np

from torchalpa.core.opgraph import OpGraph, block_of
from torchalpa.core.options import PipeshardParallel

__all__ = ["assign_layers", "cluster_layers", "layers_from_markers", "assign_rest", "MARKER_OP",
           "parameter_ops", "with_their_readers"]

MARKER_OP = "torchalpa.pipeline_boundary.default"


def assign_layers(graph: OpGraph, method: PipeshardParallel, num_devices: int) -> dict[str, int]:
    """Every node's layer: markers if the model has them, else Alpa's construction."""
    marked = layers_from_markers(graph)
    option = method.layer_option
    if marked is not None and option.layer_num == "auto":
        return marked
    forward_ops = sum(1 for n in graph.ops() if n.phase == "forward")
    num = option.layer_num if isinstance(option.layer_num, int) else \
        min(2 * num_devices, 16, forward_ops)
    return cluster_layers(graph, num, option.eps)


def _forward_ops(graph: OpGraph) -> list[str]:
    return [n.name for n in graph.ops() if n.phase == "forward"]


def _live_bytes_at_cuts(graph: OpGraph, order: list[str]) -> np.ndarray:
    """cut[p] = bytes of forward values made before op p and read at or after it."""
    pos = {name: i for i, name in enumerate(order)}
    delta = np.zeros(len(order) + 1)
    for name in order:
        node = graph.node(name)
        readers = [pos[c] for c in graph.consumers(name) if c in pos]
        if readers:
            # alive on cuts p with pos[name] < p <= last reader
            delta[pos[name] + 1] += node.outputs[0].nbytes
            delta[max(readers) + 1] -= node.outputs[0].nbytes
    return np.cumsum(delta)[: len(order) + 1]


def cluster_layers(graph: OpGraph, num_layers: int, eps: float = 0.6) -> dict[str, int]:
    """Alpa's automatic layers: ``num_layers`` flops-balanced layers, fewest bytes cut
    (the ops computed from parameters alone are placed with their readers afterwards:
    ``parameter_ops``)."""
    following = parameter_ops(graph)
    order = [name for name in _forward_ops(graph) if name not in following]
    if num_layers < 1:
        raise ValueError(f"layer_num must be >= 1, got {num_layers}")
    if num_layers > len(order):
        raise ValueError(f"layer_num={num_layers} but the forward pass has only {len(order)} ops")
    flops = np.array([graph.node(n).flops for n in order], dtype=float)
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    cut = _live_bytes_at_cuts(graph, order)
    starts = _block_starts(graph, order)
    K = len(order)
    closed = _inside_checkpointed(graph, order)
    if K - 1 - int(closed[1:K].sum()) < num_layers - 1:
        closed = None        # fewer checkpointed blocks than layers: some cut splits one
    while True:
        average = prefix[-1] / num_layers
        cuts = _segment(prefix, cut, K, num_layers, (1 + eps) * average,
                        max(0.0, 1 - eps) * average, starts, closed)
        if cuts is not None:
            break
        eps = eps * 2 if eps > 0 else 0.1  # ops too coarse for the bounds: relax them
    forward = {}
    for layer, (a, b) in enumerate(zip([0, *cuts], [*cuts, K])):
        for name in order[a:b]:
            forward[name] = layer
    return assign_rest(graph, with_their_readers(graph, forward, following))


def parameter_ops(graph: OpGraph) -> set[str]:
    """Forward ops computed from parameters alone, outside the modules that read them
    (mixed precision's casts of the float32 masters).

    ``CastForward`` casts every parameter where forward begins, so its casts come first
    in forward's order wherever their readers are. Cut by that order, they would all sit
    in the first layer -- the first stage would cast every stage's weights and send them,
    and every cut would count the casts still to be read as bytes to send, pushing the
    cuts off balance (LLaMA-3-70B in bfloat16: 11 distinct layers of 16, 4 without the
    casts). A parameter joins the layer of its first reader; these ops do too
    (``with_their_readers``). An op of the module that reads it (a Linear's transposed
    weight) already sits beside its reader and stays in the order."""
    found: set[str] = set()
    for node in graph.ops():
        if node.phase == "forward" and node.operands and all(
                graph.node(r.node).kind == "param" or r.node in found for r in node.operands):
            found.add(node.name)
    out = set()
    for name in found:
        readers = [graph.node(c) for c in graph.consumers(name)]
        modules = {r.module for r in readers if r.phase == "forward"}
        if modules and graph.node(name).module not in modules:
            out.add(name)
    return out


def with_their_readers(graph: OpGraph, forward: dict[str, int], following: set[str]
                       ) -> dict[str, int]:
    """``forward`` (forward op -> layer) with each op of ``following`` (computed from
    parameters alone) in the first layer of the forward ops that read it, those read
    only by another such op following that one (a new dict)."""
    placed = {name: at for name, at in forward.items() if name not in following}
    for name in reversed([n for n in _forward_ops(graph) if n in following]):
        readers = [placed[c] for c in graph.consumers(name) if c in placed]
        placed[name] = min(readers) if readers else forward.get(name, 0)
    return placed


def _block_starts(graph: OpGraph, order: list[str]) -> np.ndarray:
    """1.0 where op p begins another numbered block (``layers.3`` after ``layers.2``)."""
    starts = np.zeros(len(order) + 1)
    previous = None
    for p, name in enumerate(order):
        block = block_of(graph.node(name).module) if graph.node(name).module else None
        if block is not None and block != previous:
            starts[p] = 1.0
        previous = block if block is not None else previous
    return starts


def _inside_checkpointed(graph: OpGraph, order: list[str]) -> np.ndarray:
    """True at the cut positions p inside a checkpointed block (between its first and its
    last forward op; ``graph.meta["remat"]["checkpointed"]``). Backward recomputes such a
    block's forward from its input: cut inside, the later layer's part would recompute
    from values the earlier layer's part recomputes in its own backward, which runs after
    the later stage's backward -- a value sent to a later stage in backward, which no
    pipeline schedule can run."""
    closed = np.zeros(len(order) + 1, dtype=bool)
    checkpointed = set((graph.meta.get("remat") or {}).get("checkpointed", ()))
    span: dict = {}
    for p, name in enumerate(order):
        block = block_of(graph.node(name).module)
        if block in checkpointed:
            span[block] = (span.get(block, (p, p))[0], p)
    for first, last in span.values():
        closed[first + 1:last + 1] = True
    return closed


def _segment(prefix, cut, K, L, upper, lower=0.0, starts=None, closed=None):
    """Cut positions 0 < c_1 < ... < c_{L-1} < K minimizing sum cut[c], each segment's
    flops within [lower, upper], none where ``closed``; None if impossible."""
    INF = float("inf")
    tie_weight = 0.1 / (max(prefix[K], 1.0) * L)
    f_prev = np.full(K + 1, INF)
    f_prev[0] = 0.0
    back = np.zeros((L + 1, K + 1), dtype=np.int64)
    for layer in range(1, L + 1):
        f = np.full(K + 1, INF)
        window: deque = deque()      # candidate starts q, f_prev increasing
        q_lo = q_next = 0            # starts in [q_lo, q_next) have been considered
        for p in range(1, K + 1):
            # admit starts whose segment q..p-1 is now heavy enough
            while q_next < p and prefix[p] - prefix[q_next] >= lower:
                if f_prev[q_next] < INF:
                    while window and f_prev[window[-1]] >= f_prev[q_next]:
                        window.pop()
                    window.append(q_next)
                q_next += 1
            # drop starts whose segment is now too heavy
            while prefix[p] - prefix[q_lo] > upper and q_lo < p - 1:
                q_lo += 1
            while window and window[0] < q_lo:
                window.popleft()
            if prefix[p] - prefix[p - 1] > upper or not window or \
                    (closed is not None and p < K and closed[p]):
                continue
            q = window[0]
            # ties in bytes go to the start of a repeated block (a quarter byte), then to
            # the cut nearest the balanced position (less than that in total)
            tie = abs(prefix[p] - layer * prefix[K] / L) * tie_weight
            if starts is not None and p < K and not starts[p]:
                tie += 0.25
            f[p] = f_prev[q] + (cut[p] if p < K else 0.0) + tie
            back[layer, p] = q
        f_prev = f
    if f_prev[K] == INF:
        return None
    cuts, p = [], K
    for layer in range(L, 0, -1):
        p = back[layer, p]
        cuts.append(p)
    return sorted(c for c in cuts if c > 0)


def layers_from_markers(graph: OpGraph, marker_op: str = MARKER_OP) -> dict[str, int] | None:
    """Layers cut after each pipeline-boundary marker in forward; None without markers."""
    order = _forward_ops(graph)
    if not any(graph.node(n).op == marker_op for n in order):
        return None
    forward, layer = {}, 0
    for name in order:
        forward[name] = layer
        if graph.node(name).op == marker_op:
            layer += 1
    return assign_rest(graph, with_their_readers(graph, forward, parameter_ops(graph)))


def assign_rest(graph: OpGraph, forward: dict[str, int]) -> dict[str, int]:
    """Layers for leaves and backward ops, given the forward ops' layers."""
    layer = dict(forward)
    by_module: dict[str, Counter] = {}
    for name, l in forward.items():
        by_module.setdefault(graph.node(name).module, Counter())[l] += 1
    module_layer = {m: c.most_common(1)[0][0] for m, c in by_module.items()}
    last = max(forward.values(), default=0)
    for node in graph:
        if node.name in layer or node.is_leaf:
            continue
        known = [layer[r.node] for r in node.operands if r.node in layer]
        forward_known = [layer[r.node] for r in node.operands if r.node in forward]
        if node.module in module_layer and node.module:
            guess = module_layer[node.module]
        else:
            guess = max(forward_known) if forward_known else (min(known) if known else last)
        # gradients flow from later layers to earlier ones: never after a backward operand
        backward_known = [l for r, l in zip(node.operands, known) if r.node not in forward
                          and not graph.node(r.node).is_leaf]
        if backward_known:
            guess = min(guess, min(backward_known))
        layer[node.name] = guess
    for node in graph:
        if node.is_leaf:
            readers = [layer[c] for c in graph.consumers(node.name) if c in layer]
            layer[node.name] = min(readers) if readers else 0
    _gradients_with_their_parameters(graph, forward, layer)
    return layer


def _gradients_with_their_parameters(graph: OpGraph, forward: dict[str, int],
                                     layer: dict[str, int]) -> None:
    """Move the backward ops that make a parameter's gradient up to the parameter's layer
    where they sit in an earlier one (``layer`` is changed in place).

    A cut inside a module (a Linear's matmul in layer 1, its bias add in layer 2) leaves
    the module's backward ops in its first layer, so the bias gradient would be made in
    layer 1 and sent to its owner, layer 2: a value flowing to a later stage in backward,
    which no pipeline schedule can run (the later stage waits for it before the earlier
    one has started its backward). Such ops only read gradients of later layers, so they
    can run in the owner's layer; an op that an earlier layer also reads, or that reads a
    gradient of an earlier layer, stays, and so does every op of the chain that reads it.
    """
    leaf = {n.name for n in graph if n.is_leaf}
    for fqn, ref in graph.outputs.grads:
        owner = layer[graph.params[fqn]]
        chain, stack = set(), [ref.node]         # backward ops before the owner's layer
        while stack:
            name = stack.pop()
            if name in chain or name in forward or name in leaf or layer[name] >= owner:
                continue
            chain.add(name)
            stack.extend(r.node for r in graph.node(name).operands)
        # an op stays where an earlier layer outside the chain reads it or it reads a
        # gradient of an earlier layer; what reads an op that stays must stay too
        stay = {n for n in chain if any(layer[c] < owner and c not in chain
                                        for c in graph.consumers(n))
                or any(r.node not in chain and r.node not in forward and r.node not in leaf
                       and layer[r.node] < owner for r in graph.node(n).operands)}
        pending = list(stay)
        while pending:
            for c in graph.consumers(pending.pop()):
                if c in chain and c not in stay:
                    stay.add(c)
                    pending.append(c)
        for name in chain - stay:
            layer[name] = owner
