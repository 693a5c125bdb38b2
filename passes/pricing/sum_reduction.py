"""Memory where a step that sums its gradients over micro-batches reduces the sums.

With several micro-batches the runtime adds each micro-batch's raw gradients into sums
(``runtime/rewrites/grad_sums.py``) and reshards the sums once, after the last backward
(``runtime/execution/step.py``, ``StepRunner.gradients``): bucket by bucket
(``runtime/rewrites/buckets.py``), each sum freed once its bucket is packed
(``release_inputs``). What one device holds there, before the optimizer step
(``step_end.py``):

- the parameters, buffers and optimizer states;
- the sums, as the ops that make the gradients lay them out (``memory.
  accumulated_gradients``: whole over the data-parallel axis); a packed sum's place is
  taken by the packed buffer (NCCL) or gloo's copy of it, held until the step's last wait;
- the reduced gradients in their parameters' layout: ZeRO's blocks, and data
  parallelism's flat buffers, which the runtime keeps from step to step
  (``runtime/rewrites/kept_buckets.py``);
- where a reduce-scatter shrinks a bucket's sums, the bucket packed beside its members
  once: its members' bytes beyond their blocks, ``(sum - block) x n / (n - 1)`` summed
  over the bucket, for ``n`` the mesh's devices (exactly the sums' bytes on a 1-D mesh;
  a plan that scatters over one axis of a 2-D mesh packs more than this counts). An
  all-reduce packs into the kept buffer, which the reduced gradients count.

No activations: every micro-batch's backward has run. Where activations are small beside
the model this point is above backward's peak (the reduced gradients beside the sums):
the plan's end of step is the larger of it and the optimizer step
(``Estimates.end_of_step_bytes_per_device``; the ILP's rows at ``MemoryModel.end``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchalpa.core.cluster import GRADIENT_BUCKET_BYTES
from torchalpa.core.opgraph import OpGraph, ValueRef
from torchalpa.core.placement import Placements
from torchalpa.passes.pricing.grad_buckets import bucket_members
from torchalpa.passes.sharding.reshard import local_bytes

__all__ = ["SumReduction", "sum_reduction", "sum_reduction_bytes"]


@dataclass(frozen=True)
class SumReduction:
    """What one device holds where the sums are reduced (module doc), in terms of its
    leaves' and the sums' local blocks: the one description the plan's estimate
    (``bytes``) and the ILP's rows (``MemoryModel``) both read.

    ``copies``: leaf -> tensors of its layout (itself; a trained parameter's optimizer
    states and reduced gradient too). ``sums``: parameter -> the op result its sum is laid
    out as. ``buckets``: the parameters packed together, in the runtime's buckets.
    ``spread``: ``n / (n - 1)``, the sum's bytes per byte a reduce-scatter sheds."""

    copies: dict[str, int]
    sums: dict[str, ValueRef]
    buckets: tuple[tuple[str, ...], ...]
    spread: float

    def bytes(self, local: dict[str, int], summed: dict[str, int]) -> float:
        """Bytes one device holds: leaf ``name``'s block ``local[name]`` bytes, parameter
        ``name``'s sum ``summed[name]`` bytes."""
        base = float(sum(self.copies[name] * local[name] for name in self.copies)) + \
            float(sum(summed[name] for name in self.sums))
        packed = max((sum((summed[p] - local[p]) * self.spread for p in bucket)
                      for bucket in self.buckets), default=0.0)
        return base + max(packed, 0.0)


def sum_reduction(graph: OpGraph, optimizer_states: int, num_devices: int,
                  bucket_bytes: float = GRADIENT_BUCKET_BYTES) -> SumReduction | None:
    """``graph``'s ``SumReduction`` with ``optimizer_states`` state tensors per parameter on
    a mesh of ``num_devices``; None where nothing is reduced (one device) or the
    parameters live in host memory (negative ``optimizer_states``)."""
    if optimizer_states < 0 or num_devices < 2:
        return None
    params = {n.target: n.name for n in graph if n.kind == "param"}
    sums = {params[target]: ref for target, ref in graph.outputs.grads
            if target in params and graph.node(ref.node).kind == "op"}
    if not sums:
        return None
    copies = {n.name: (2 + optimizer_states if n.name in sums else 1)
              for n in graph if n.kind in ("param", "buffer")}
    names = list(sums)
    sizes = [(graph.spec(sums[p]).nbytes, graph.spec(sums[p]).itemsize) for p in names]
    buckets = tuple(tuple(names[i] for i in members)
                    for members in bucket_members(sizes, bucket_bytes))
    return SumReduction(copies, sums, buckets, num_devices / (num_devices - 1))


def sum_reduction_bytes(graph: OpGraph, placements: dict[str, Placements],
                        outputs: dict[str, tuple[Placements, ...]], mesh_shape,
                        optimizer_states: int,
                        bucket_bytes: float = GRADIENT_BUCKET_BYTES) -> float:
    """Bytes one device holds where the sums are reduced (module doc), leaves laid out as
    ``placements`` and ops' results as ``outputs`` (node -> its results' layouts); 0 where
    nothing is reduced."""
    found = sum_reduction(graph, optimizer_states, math.prod(mesh_shape), bucket_bytes)
    if found is None:
        return 0.0
    local = {name: int(local_bytes(graph.node(name).output, placements[name], mesh_shape))
             for name in found.copies}
    summed = {name: int(local_bytes(graph.spec(ref), outputs[ref.node][ref.index], mesh_shape))
              for name, ref in found.sums.items()}
    return found.bytes(local, summed)
