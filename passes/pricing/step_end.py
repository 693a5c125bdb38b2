"""Memory at the end of a step, where the optimizer updates the parameters.

What one device holds there, per plan kind, as the runtime runs it
(``runtime/execution/step.py``, ``StepRunner.gradients``; ``runtime/execution/optim.py``):

- every plan: the parameters and the optimizer's states (their layout), the reduced
  gradients in their parameters' layout (``p.grad``: with data parallelism views of the
  flat buffers the buckets were all-reduced in, with ZeRO the reduce-scattered blocks),
  and the optimizer's temporaries (``core/optimizer_step.py``: Adam's square root and
  quotient of one parameter tensor by tensor, of all of them with ``foreach``);
- no activations: every micro-batch's backward has run (a pipeline stage's too), and what
  forward saved is freed;
- no gradient sums over micro-batches: each is freed once the reduction has packed it
  (``release_inputs``), and the sums are scaled in place.

So the point costs ``parameters x (1 + states) + gradients + temporaries``. Where
activations are small beside the model (a big model, a small batch; ZeRO or DP plans)
this is the step's peak, above anything in forward and backward: the planner's peak is
the larger of the two (``MemoryModel``'s last point; ``Estimates.end_of_step_bytes_per_device``).
The reduction's own transients (a bucket packed beside its members; gloo's reduce-scatter
copying its input) are priced where a step of one micro-batch reduces in backward
(``memory.scatter_copies``, at each bucket's packing: ``grad_buckets.py``); where the step
sums micro-batches and reduces the sums after its last backward, that reduction is a point
of its own just before this one (``sum_reduction.py``), and the plan's end of step is the
larger of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchalpa.core.opgraph import OpGraph
from torchalpa.core.optimizer_step import (
    FOREACH_MAX_GROUP_NUMEL,
    FOREACH_TEMPORARIES,
    LOOP_TEMPORARIES,
    optimizer_temporary_bytes,
    steps_foreach,
)
from torchalpa.core.options import OPTIMIZER_STATES
from torchalpa.core.placement import Placements
from torchalpa.passes.sharding.reshard import local_bytes

__all__ = ["trained_parameters", "updates_on_device", "StepEnd", "step_end", "end_of_step_bytes",
           "device_type_of"]


def trained_parameters(graph: OpGraph) -> list[str]:
    """Names of the parameter nodes that get a gradient, in graph order."""
    targets = dict(graph.outputs.grads)
    return [n.name for n in graph if n.kind == "param" and n.target in targets]


def updates_on_device(optimizer: str, optimizer_states: int) -> bool:
    """Whether the optimizer's update runs on the devices: its states are there (not
    offloaded to host memory, where the host's step makes its temporaries)."""
    return optimizer_states >= 0 and optimizer_states == OPTIMIZER_STATES.get(optimizer, -1)


def device_type_of(backend: str) -> str:
    """The device a mesh's collective backend runs on: NCCL GPUs, else CPU."""
    return "cuda" if backend == "nccl" else "cpu"


@dataclass(frozen=True)
class StepEnd:
    """What one device holds at the optimizer step, in terms of its leaves' local blocks:
    the one description the plan's estimate (``bytes``) and the ILP's memory rows
    (``passes/pricing/memory.py``, ``MemoryModel.end_rows``) both read.

    ``copies``: leaf -> tensors of its layout held there (itself; a trained parameter's
    gradient and optimizer states too). ``trained``: the trained parameters, whose blocks
    the update's temporaries copy (``core/optimizer_step.py``): ``per_block`` copies of
    every one of them where the step runs ``foreach``, ``per_largest`` copies of the
    largest block where it runs tensor by tensor. ``foreach``: which runs, where the
    parameters' whole sizes decide it (True: GPUs, or CPU groups small even whole;
    False: no temporaries), or None where only the local blocks' sizes do (CPU groups too
    large whole for ``foreach``: split over devices they may step either way)."""

    optimizer: str
    copies: dict[str, int]
    trained: tuple[str, ...]
    foreach: bool | None
    per_block: int
    per_largest: int

    def bytes(self, local: dict[str, int], itemsize: dict[str, int], device_type: str) -> float:
        """Bytes one device holds, leaf ``name``'s block being ``local[name]`` bytes of
        ``itemsize[name]`` each."""
        total = float(sum(self.copies[name] * local[name] for name in self.copies))
        if self.foreach is False:
            return total
        blocks = [(local[name] // max(itemsize[name], 1), local[name]) for name in self.trained]
        return total + optimizer_temporary_bytes(self.optimizer, blocks, device_type)

    def foreach_cap(self, itemsize: dict[str, int]) -> float:
        """Bytes the ``foreach`` temporaries reach at most where the blocks' sizes decide
        (``foreach`` None): the runtime steps a group with ``foreach`` on CPU only while
        it has ``FOREACH_MAX_GROUP_NUMEL`` elements or fewer."""
        most = max((itemsize[name] for name in self.trained), default=0)
        return float(self.per_block * FOREACH_MAX_GROUP_NUMEL * most)


def step_end(graph: OpGraph, optimizer: str, optimizer_states: int,
             device_type: str) -> StepEnd | None:
    """``graph``'s ``StepEnd`` under ``optimizer`` with ``optimizer_states`` state tensors
    per parameter on ``device_type``; None where the parameters live in host memory
    (negative ``optimizer_states``): nothing of the step's end is on the device."""
    if optimizer_states < 0:
        return None
    trained = trained_parameters(graph)
    chosen = set(trained)
    copies = {n.name: (2 + optimizer_states if n.name in chosen else 1)
              for n in graph if n.kind in ("param", "buffer")}
    if not trained or not updates_on_device(optimizer, optimizer_states):
        foreach: bool | None = False
    elif steps_foreach([graph.node(name).output.numel for name in trained], device_type):
        foreach = True           # the blocks, no larger than the whole, step so too
    else:
        foreach = None
    return StepEnd(optimizer, copies, tuple(trained), foreach, FOREACH_TEMPORARIES.get(optimizer, 1),
                   LOOP_TEMPORARIES.get(optimizer, 2))


def end_of_step_bytes(graph: OpGraph, placements: dict[str, Placements], mesh_shape,
                      optimizer: str, optimizer_states: int, device_type: str) -> float:
    """Bytes one device holds at the optimizer step (module doc), leaves laid out as
    ``placements`` (node -> its layout); 0 where the parameters live in host memory."""
    end = step_end(graph, optimizer, optimizer_states, device_type)
    if end is None:
        return 0.0
    local = {name: int(local_bytes(graph.node(name).output, placements[name], mesh_shape))
             for name in end.copies}
    itemsize = {name: graph.node(name).output.itemsize for name in end.copies}
    return end.bytes(local, itemsize, device_type)
