"""Layers: contiguous groups of ops, the unit pipeline stages are made of.

Forward ops are cut into layers either where the model says
(``torchalpa.mark_pipeline_boundary()``) or by Alpa's layer-construction DP: ``L`` layers,
each with at most ``(1 + eps)`` times the average forward flops, minimizing the bytes of
activations alive across the cuts (what a pipeline has to send between stages); ties go
to the most balanced cuts. A cut's cost is separable, so the DP keeps, for each cut
position, the cheapest way to reach it, and a sliding-window minimum makes it O(L x ops).

Everything else follows the forward ops: parameters join the layer of their first
reader, inputs the layer of theirs, and each backward op the layer of the forward ops of
its module (autograd tags it with them); ops autograd adds without a module join their
operands' layer. A backward op never sits in a later layer than a backward op it reads:
gradients must flow from later stages to earlier ones for a pipeline to run.
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np

from torchalpa.opgraph import OpGraph

__all__ = ["cluster_layers", "layers_from_markers", "assign_rest", "MARKER_OP"]

MARKER_OP = "torchalpa.pipeline_boundary.default"


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
    """Alpa's automatic layers: ``num_layers`` flops-balanced layers, fewest bytes cut."""
    order = _forward_ops(graph)
    if num_layers < 1:
        raise ValueError(f"layer_num must be >= 1, got {num_layers}")
    if num_layers > len(order):
        raise ValueError(f"layer_num={num_layers} but the forward pass has only {len(order)} ops")
    flops = np.array([graph.node(n).flops for n in order], dtype=float)
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    cut = _live_bytes_at_cuts(graph, order)
    K = len(order)
    while True:
        bound = (1 + eps) * prefix[-1] / num_layers
        cuts = _segment(prefix, cut, K, num_layers, bound)
        if cuts is not None:
            break
        eps *= 2  # a single op above the bound: relax until the layers exist
    forward = {}
    for layer, (a, b) in enumerate(zip([0, *cuts], [*cuts, K])):
        for name in order[a:b]:
            forward[name] = layer
    return assign_rest(graph, forward)


def _segment(prefix, cut, K, L, bound):
    """Cut positions 0 < c_1 < ... < c_{L-1} < K minimizing sum cut[c], each segment's
    flops <= bound; None if impossible."""
    INF = float("inf")
    tie_weight = 0.5 / (max(prefix[K], 1.0) * L)
    f_prev = np.full(K + 1, INF)
    f_prev[0] = 0.0
    back = np.zeros((L + 1, K + 1), dtype=np.int64)
    for layer in range(1, L + 1):
        f = np.full(K + 1, INF)
        window: deque = deque()      # candidate starts q, f_prev increasing
        q_lo = 0
        for p in range(1, K + 1):
            q_new = p - 1
            if f_prev[q_new] < INF:
                while window and f_prev[window[-1]] >= f_prev[q_new]:
                    window.pop()
                window.append(q_new)
            while prefix[p] - prefix[q_lo] > bound and q_lo < p - 1:
                q_lo += 1
            while window and window[0] < q_lo:
                window.popleft()
            if prefix[p] - prefix[p - 1] > bound:
                continue
            if window:
                q = window[0]
                # ties in bytes go to the cut nearest the balanced position (< 1 byte in total)
                tie = abs(prefix[p] - layer * prefix[K] / L) * tie_weight
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
    return assign_rest(graph, forward)


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
    return layer
