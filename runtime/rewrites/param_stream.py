"""Stream parameters from host memory per op, and gradients back as backward makes them.

With ``AutoShardingOption.offload_parameters`` a rank's parameter blocks live in host memory
(pinned where CUDA exists; ``runtime.execution.module`` moves them there) and the optimizer
steps them there (``runtime.execution.host_optimizer``). ``stream_parameters`` rewrites a
stage's lowered programs so that the devices hold only the parameters in use:

- forward: every read of a parameter reads a device copy made by ``fetch`` (a copy issued
  on a side stream) and ``ready`` (the compute stream waits for it). Each parameter's
  ``fetch`` is placed before the first reader of the parameter read before it, so its copy
  travels while that one's ops run (one ahead, as FSDP prefetches); the program drops the
  copy after its last reader. What forward saves for backward keeps the host parameter,
  never a copy (the plan gathers parameters again in backward: ``rematerialize_parameters``);
- backward: the parameters it takes from forward are read the same way;
- each gradient goes to the host (``to_host``, on the side stream) right after the op that
  makes it, so its device memory is free as backward goes on; ``drain`` waits for the
  copies at the end of backward, before anyone reads them.

Without CUDA the "device" is host memory too, and the copies are plain copies: the same
program runs, which is what the CPU tests check (that training is unchanged).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx

from torchalpa.runtime.lowering.rank_programs import StageProgram

__all__ = ["stream_parameters", "fetch", "ready", "to_host", "drain", "Fetched"]

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
_PENDING: list = []       # (device gradient, event) whose host copies are in flight


def _cuda() -> bool:
    return torch.cuda.is_available()


def _side_stream() -> torch.cuda.Stream:
    device = torch.cuda.current_device()
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class Fetched:
    """A device copy in flight: the copy and the event its stream records after it."""

    __slots__ = ("copy", "event")

    def __init__(self, copy: torch.Tensor, event):
        self.copy, self.event = copy, event


def fetch(host: torch.Tensor) -> Fetched:
    """Start copying ``host`` to the device (a side stream; without CUDA, a plain copy)."""
    if not _cuda():
        return Fetched(host.clone(), None)
    side = _side_stream()
    with torch.cuda.stream(side):
        copy = host.to(torch.cuda.current_device(), non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    return Fetched(copy, event)


def ready(fetched: Fetched) -> torch.Tensor:
    """The device copy, once the compute stream has waited for it."""
    if fetched.event is not None:
        current = torch.cuda.current_stream()
        current.wait_event(fetched.event)
        fetched.copy.record_stream(current)       # freed only after the compute stream
    return fetched.copy


def to_host(grad: torch.Tensor | None) -> torch.Tensor | None:
    """Start copying a gradient to host memory (pinned, on the side stream, after the op
    that made it); without CUDA, a plain copy."""
    if grad is None or grad.device.type == "cpu":
        return None if grad is None else grad.clone()
    side = _side_stream()
    made = torch.cuda.Event()
    made.record(torch.cuda.current_stream())
    host = torch.empty(grad.shape, dtype=grad.dtype, device="cpu", pin_memory=True)
    with torch.cuda.stream(side):
        side.wait_event(made)
        host.copy_(grad, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    _PENDING.append((grad, done))         # the device gradient lives until its copy is done
    return host


def drain(*host_grads) -> None:
    """Wait for the gradients' copies to the host (end of backward)."""
    while _PENDING:
        _, done = _PENDING.pop()
        done.synchronize()


def _rewire_reads(graph: fx.Graph, params: list[fx.Node]) -> int:
    """Every read of ``params`` (not the output's) through ``fetch``/``ready``, each fetch
    one ahead of its parameter's first reader; returns how many parameters were streamed."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    readers = {p: [u for u in p.users if u.op != "output"] for p in params}
    used = sorted((p for p in params if readers[p]),
                  key=lambda p: min(order[u] for u in readers[p]))
    before = None
    for p in used:
        first = min(readers[p], key=lambda u: order[u])
        with graph.inserting_before(before if before is not None else first):
            fetched = graph.call_function(fetch, (p,))
        with graph.inserting_before(first):
            copy = graph.call_function(ready, (fetched,))
        for u in readers[p]:
            u.replace_input_with(p, copy)
        before = first
    return len(used)


def _gradients_to_host(graph: fx.Graph, num_grads: int) -> None:
    """Each of the output's first ``num_grads`` values copied to the host right after the
    op that makes it; ``drain`` before the output."""
    output = next(n for n in graph.nodes if n.op == "output")
    values = list(output.args[0])
    hosted = []
    for i, g in enumerate(values[:num_grads]):
        if not isinstance(g, fx.Node):
            continue
        with graph.inserting_after(g):
            h = graph.call_function(to_host, (g,))
        values[i] = h
        hosted.append(h)
    with graph.inserting_before(output):
        graph.call_function(drain, tuple(hosted))
    output.args = (tuple(values),)


def stream_parameters(stage: StageProgram) -> StageProgram:
    """``stage`` whose forward and backward read parameters from host memory through
    device copies and copy gradients to the host as backward makes them (module doc)."""
    forward = fx.GraphModule(stage.forward, stage.forward.graph.__deepcopy__())
    backward = fx.GraphModule(stage.backward, stage.backward.graph.__deepcopy__())
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    params = placeholders[:len(stage.params)]
    output = next(n for n in forward.graph.nodes if n.op == "output")
    saved = list(output.args[0])[stage.num_results:]
    _rewire_reads(forward.graph, params)
    taken = [n for n in backward.graph.nodes if n.op == "placeholder"]
    _rewire_reads(backward.graph, [taken[j] for j, v in enumerate(saved) if v in params])
    _gradients_to_host(backward.graph, len(stage.grad_present))
    for gm in (forward, backward):
        gm.graph.lint()
        gm.recompile()
    return replace(stage, forward=forward, backward=backward)
