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
Not priced: the reduction's own transients (one bucket being packed beside its members;
gloo's reduce-scatter copying its input), bounded by a bucket's size (25 MiB).
"""

from __future__ import annotations

from torchalpa.core.opgraph import OpGraph
from torchalpa.core.optimizer_step import optimizer_temporary_bytes
from torchalpa.core.options import OPTIMIZER_STATES
from torchalpa.core.placement import Placements
from torchalpa.passes.sharding.reshard import local_bytes

__all__ = ["trained_parameters", "updates_on_device", "end_of_step_bytes", "device_type_of"]


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


def end_of_step_bytes(graph: OpGraph, placements: dict[str, Placements], mesh_shape,
                      optimizer: str, optimizer_states: int, device_type: str) -> float:
    """Bytes one device holds at the optimizer step (module doc), leaves laid out as
    ``placements`` (node -> its layout); 0 where the parameters live in host memory."""
    if optimizer_states < 0:
        return 0.0
    trained = set(trained_parameters(graph))
    total = 0.0
    local: list[tuple[int, int]] = []
    for n in graph:
        if n.kind not in ("param", "buffer"):
            continue
        nbytes = local_bytes(n.output, placements[n.name], mesh_shape)
        if n.name not in trained:
            total += nbytes
            continue
        total += nbytes * (2 + optimizer_states)        # itself, its gradient, its states
        local.append((int(nbytes) // max(n.output.itemsize, 1), int(nbytes)))
    if updates_on_device(optimizer, optimizer_states):
        total += optimizer_temporary_bytes(optimizer, local, device_type)
    return total

