"""Memory where a step of several micro-batches gathers its parameters, before the first.

With gradient accumulation a plan that keeps parameters split between steps (ZeRO-2)
gathers each one forward reads whole once per step, before its first micro-batch
(``runtime/rewrites/param_gather.py``, ``plan.state_read_once``): in forward's order,
gathers of one element size packed into buckets of at most the bucket cap of contributed
bytes (``gather_buckets``), one all-gather each. What one device holds there:

- the parameters, buffers and optimizer states (their layout); no gradients, no sums,
  no activations: the previous step's gradients were dropped (``zero_grad``) and no
  micro-batch has run;
- the gathered copies of the buckets already gathered (held for the step: ``memory``
  counts them from the step's start as the forward views that read them);
- at the bucket being gathered, the larger of two moments. At the collective: its
  members' blocks packed into one buffer (``flatten_concat``), the gathered flat buffer,
  and the backend's own output where it makes one (``gather_copies``). At the split
  after it: the flat buffer beside the members' gathered copies made from it
  (``split_gathered``), once the packed buffer has died. A parameter gathered alone is
  neither packed nor split: its gathered output is its copy.

A member's gathered copy is priced as ``(read - block) x n / (n - 1)``, ``read`` the
bytes its first forward reader that reads its data (not its shape only: a layout, not
None) takes it in, ``block`` its own layout's, ``n`` the mesh's devices: the whole
parameter where a 1-D mesh gathers a block of it, nothing where forward reads it as laid
out (data parallelism, a tensor-parallel shard); linear in the two nodes' choices, so the
ILP's rows (``MemoryModel``) read it as the estimate does (a plan that gathers over one
axis of a 2-D mesh holds more than this counts). The packed buffer is ``1 / n`` of it,
the member's block. Buckets are formed from the whole parameters' bytes over ``n``
(ZeRO-2's blocks on a 1-D mesh).

The point holds no activations, so it sits beside the step's end (``step_end.py``,
``sum_reduction.py``): between two steps the same leaves are held; it is one more of the
ILP's rows at ``MemoryModel.end`` and the plan's end of step is the largest of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchalpa.core.cluster import GRADIENT_BUCKET_BYTES
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.placement import Placements
from torchalpa.passes.sharding.reshard import local_bytes

__all__ = ["StateGather", "gather_copies", "state_gather", "state_gather_bytes"]


def gather_copies(device_type: str) -> int:
    """Copies of a gathered bucket the backend makes beside the output it is given: gloo
    (CPU ranks) gathers into a flat buffer of its own and copies that into the output
    (measured on 2 gloo ranks: ``tests/end_of_step_worker.py``, ZeRO-2 with micro-batches);
    NCCL gathers into the output itself."""
    return 1 if device_type == "cpu" else 0


@dataclass(frozen=True)
class StateGather:
    """What one device holds where the step gathers its parameters (module doc), in terms
    of its leaves' local blocks and the bytes forward reads them in: the one description
    the plan's estimate (``bytes``) and the ILP's rows (``MemoryModel``) both read.

    ``copies``: leaf -> tensors of its layout held (itself; a trained parameter's
    optimizer states too). ``reads``: leaf -> its forward reads (reader, operand slot), in
    order: the first that reads its data gathers it.
    ``buckets``: the leaves of ``reads`` gathered together, in the runtime's order.
    ``spread``: ``n / (n - 1)``. ``devices``: ``n``. ``backend_copies``: ``gather_copies``."""

    copies: dict[str, int]
    reads: dict[str, tuple[tuple[str, int], ...]]
    buckets: tuple[tuple[str, ...], ...]
    spread: float
    devices: int
    backend_copies: int

    def factor(self, bucket: tuple[str, ...]) -> float:
        """Bytes held at ``bucket``'s gather per byte of its gathered copies: the flat
        buffer and the larger of (the packed blocks and the backend's copy) and (the
        copies split from it); a lone member: its output and the backend's copy."""
        if len(bucket) == 1:
            return 1.0 + self.backend_copies
        return 1.0 + max(1.0, 1.0 / self.devices + self.backend_copies)

    def bytes(self, local: dict[str, int], read: dict[str, int]) -> float:
        """Bytes one device holds: leaf ``name``'s block ``local[name]`` bytes, read by its
        first forward reader in ``read[name]`` bytes."""
        base = float(sum(self.copies[name] * local[name] for name in self.copies))
        held, most = 0.0, 0.0
        for bucket in self.buckets:
            gathered = sum((read[name] - local[name]) * self.spread for name in bucket)
            most = max(most, held + gathered * self.factor(bucket))
            held += gathered
        return base + most


def _buckets(sizes: list[tuple[str, int, int]], bucket_bytes: float) -> list[tuple[str, ...]]:
    """Leaves ``sizes`` (name, contributed bytes, element size; forward's order) packed as
    ``runtime.rewrites.param_gather.gather_buckets`` packs them: by element size, a bucket
    closed where the next would pass ``bucket_bytes`` (0: each alone)."""
    open_bucket: dict[int, list[tuple[str, int]]] = {}
    closed: list[list[tuple[str, int]]] = []
    for name, nbytes, itemsize in sizes:
        members = open_bucket.get(itemsize)
        if members is None or sum(b for _, b in members) + nbytes > bucket_bytes:
            members = open_bucket[itemsize] = []
            closed.append(members)
        members.append((name, nbytes))
    return [tuple(name for name, _ in members) for members in closed]


def state_gather(graph: OpGraph, optimizer_states: int, num_devices: int, device_type: str,
                 bucket_bytes: float = GRADIENT_BUCKET_BYTES) -> StateGather | None:
    """``graph``'s ``StateGather`` with ``optimizer_states`` state tensors per trained
    parameter on a mesh of ``num_devices`` of ``device_type``, for a step that gathers
    its parameters once before its first micro-batch (the caller's
    ``plan.state_read_once``); None where nothing is gathered (one device, no leaf read
    in forward) or the parameters live in host memory (negative ``optimizer_states``)."""
    if optimizer_states < 0 or num_devices < 2:
        return None
    trained = {target for target, _ in graph.outputs.grads}
    copies = {n.name: (1 + optimizer_states if n.kind == "param" and n.target in trained
                       else 1)
              for n in graph if n.kind in ("param", "buffer")}
    found: dict[str, list[tuple[str, int]]] = {}
    for node in graph.ops():
        if node.phase != "forward":
            continue
        for slot, ref in enumerate(node.operands):
            if ref.node in copies:
                found.setdefault(ref.node, []).append((node.name, slot))
    if not found:
        return None
    reads = {name: tuple(readers) for name, readers in found.items()}
    sizes = [(name, graph.node(name).output.nbytes // num_devices,
              graph.node(name).output.itemsize) for name in reads]
    return StateGather(copies, reads, tuple(_buckets(sizes, bucket_bytes)),
                       num_devices / (num_devices - 1), num_devices, gather_copies(device_type))


def state_gather_bytes(graph: OpGraph, placements: dict[str, Placements],
                       inputs: dict[str, tuple], mesh_shape, optimizer_states: int,
                       device_type: str, bucket_bytes: float = GRADIENT_BUCKET_BYTES) -> float:
    """Bytes one device holds where the step gathers its parameters (module doc), leaves
    laid out as ``placements`` and ops reading their operands as ``inputs`` (node -> the
    layouts it reads them in; None: as made); 0 where nothing is gathered."""
    n = 1
    for size in mesh_shape:
        n *= size
    found = state_gather(graph, optimizer_states, n, device_type, bucket_bytes)
    if found is None:
        return 0.0
    local = {name: int(local_bytes(graph.node(name).output, placements[name], mesh_shape))
             for name in found.copies}
    read = {}
    for name, readers in found.reads.items():
        layout = next((inputs[r][slot] for r, slot in readers if inputs[r][slot] is not None),
                      None)
        read[name] = local[name] if layout is None else \
            int(local_bytes(graph.node(name).output, layout, mesh_shape))
    return found.bytes(local, read)
