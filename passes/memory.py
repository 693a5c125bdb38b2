"""Per-device memory of a plan: model states plus activations alive at the peak.

Model states are each parameter's local shard, its gradient (same layout) and the
optimizer's state tensors (same layout). Activations are op results held from the op
that makes them to their last reader in the step's order (forward then backward).
"""

from __future__ import annotations

from torchalpa.opgraph import OpGraph
from torchalpa.passes.reshard import local_bytes
from torchalpa.placement import Placements

__all__ = ["model_state_bytes", "activation_peak_bytes"]


def model_state_bytes(graph: OpGraph, placements: dict[str, Placements], mesh_shape,
                      optimizer_states: int) -> int:
    """Params + grads + optimizer states held by one device."""
    total = 0
    trainable = set(graph.grads)
    for node in graph:
        if node.kind not in ("param", "buffer"):
            continue
        shard = local_bytes(node.output, placements[node.name], mesh_shape)
        copies = 1 + (1 + optimizer_states if node.target in trainable else 0)
        total += shard * copies
    return total


def activation_peak_bytes(graph: OpGraph, outputs: dict[str, tuple[Placements, ...]],
                          mesh_shape) -> int:
    """Peak bytes of op results alive at once on one device (inputs count too)."""
    order = {n.name: i for i, n in enumerate(graph)}
    last_use: dict[str, int] = {}
    for node in graph:
        for ref in node.operands:
            last_use[ref.node] = max(last_use.get(ref.node, -1), order[node.name])
    end = len(order)
    for ref in [graph.outputs.loss] + [r for _, r in graph.outputs.grads]:
        last_use[ref.node] = end
    frees: dict[int, int] = {}
    live = peak = 0
    for node in graph:
        i = order[node.name]
        if node.kind in ("op", "input") and not node.is_grad:  # grads count as model state
            size = sum(local_bytes(spec, outputs[node.name][k], mesh_shape)
                       for k, spec in enumerate(node.outputs))
            live += size
            frees[last_use.get(node.name, i)] = frees.get(last_use.get(node.name, i), 0) + size
        peak = max(peak, live)
        live -= frees.pop(i, 0)
    return peak
