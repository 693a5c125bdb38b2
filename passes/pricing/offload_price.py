"""What offloading optimizer states to host memory costs (DeepSpeed's ZeRO-Offload).

With ``AutoShardingOption.offload`` the devices hold each parameter's local block and its
gradient only; every rank keeps, in host memory, a copy of its parameters' blocks (the
master copy the optimizer updates) and the optimizer's states. After backward the rank
copies its gradient blocks to the host, runs the optimizer's step there, and copies the
updated blocks back (``runtime/execution/host_optimizer.py``). The runtime does these one after the other,
after the last backward, so they are priced that way, added to the step:

- the host link, each way: a device's gradient blocks down, its parameter blocks up, at
  ``host_link_bandwidth`` (each device has its own link);
- the host's step: the optimizer reads parameter, gradient and states and writes
  parameter and states, ``(3 + 2 x states)`` bytes per parameter byte, for every device
  of a node together at the node's ``host_memory_bandwidth``.

Host memory per node: the devices' parameter blocks and their states, ``(1 + states)``
bytes per parameter byte (replicated blocks held once per rank, as the ranks do).

With ``AutoShardingOption.offload_parameters`` the parameters and gradients live on the host
too (``runtime/rewrites/param_stream.py``): each of a micro-batch's forward and backward
copies every parameter block up, one ahead of the op that reads it, on a side stream, and
backward copies each gradient down as soon as it is made. So the copies overlap the step's
work, phase by phase: forward (a third of the step, as backward does twice forward's
matrix products) pays what its copies up take beyond its compute, backward what the larger
of its copies up and down take beyond its own two thirds, and each phase the first copy
(the largest block's), which nothing hides. Per step and device, ``3 k`` times the
parameter blocks cross the link (``k`` micro-batches). The host holds parameters, gradients
and states, ``(2 + states)`` bytes per parameter byte; the devices hold at most two
parameter blocks and one gradient block in flight (at most the largest three), which the
planner reserves out of the memory budget.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchalpa.core.opgraph import OpGraph
from torchalpa.core.units import format_bytes
from torchalpa.passes.sharding.reshard import local_bytes

__all__ = ["OffloadCost", "offload_cost", "host_floor_bytes", "DEFAULT_HOST",
           "device_window_bytes", "streamed_floor_s"]

DEFAULT_HOST = {"host_link_bandwidth": 25e9, "host_memory_per_node": 1024e9,
                "host_memory_bandwidth": 200e9}
"""Host figures of a cluster that gives none (a LogicalMesh): ``Cluster``'s defaults."""


@dataclass(frozen=True)
class OffloadCost:
    """Seconds a step pays for offloaded states and the host memory they take."""

    link_s: float            # gradients down and parameters up, per device
    host_step_s: float       # the optimizer's step on the host
    host_bytes_per_device: float
    host_bytes_per_node: float
    host_memory_per_node: float
    parameters: bool = False      # parameters and gradients on the host too
    link_bytes_per_device: float = 0.0   # both ways, per step
    device_window_bytes: float = 0.0     # copies in flight on a device (parameters)

    @property
    def seconds(self) -> float:
        return self.link_s + self.host_step_s

    @property
    def fits(self) -> bool:
        return self.host_bytes_per_node <= self.host_memory_per_node

    def note(self) -> str:
        if self.parameters:
            return (f"offload: parameters, gradients and optimizer states in host memory, "
                    f"{format_bytes(self.host_bytes_per_node)} per node of "
                    f"{format_bytes(self.host_memory_per_node)}; "
                    f"{format_bytes(self.link_bytes_per_device)} per device and step over "
                    f"the host link, streamed per parameter beside compute "
                    f"({self.link_s * 1e3:.4g} ms not hidden), "
                    f"{format_bytes(self.device_window_bytes)} of copies in flight on a "
                    f"device; {self.host_step_s * 1e3:.4g} ms for the optimizer's step on "
                    "the host, after backward")
        return (f"offload: optimizer states in host memory, "
                f"{format_bytes(self.host_bytes_per_node)} per node of "
                f"{format_bytes(self.host_memory_per_node)} (parameter copies and states); "
                f"{self.seconds * 1e3:.4g} ms per step ({self.link_s * 1e3:.4g} ms over the "
                f"host link, {self.host_step_s * 1e3:.4g} ms for the optimizer's step on the "
                "host), after backward")


def _host(cluster, name: str) -> float:
    return float(getattr(cluster, name, None) or DEFAULT_HOST[name])


def trained_params(graph: OpGraph) -> list:
    """The parameters the step makes gradients for (what the optimizer updates)."""
    grads = dict(graph.outputs.grads)
    return [n for n in graph if n.kind == "param" and n.target in grads]


def offload_cost(graph: OpGraph, placements: dict, mesh_shape, optimizer_states: int,
                 cluster, devices_per_node: int, *, parameters: bool = False,
                 num_micro_batches: int = 1, step_s: float = 0.0) -> OffloadCost:
    """The offload's cost for a plan: ``placements`` maps each parameter node to its
    placements on the mesh of shape ``mesh_shape``; ``cluster`` gives the host figures.
    ``parameters``: parameters and gradients offloaded too, their copies overlapping the
    step's ``step_s`` seconds of work over ``num_micro_batches`` micro-batches."""
    blocks = [local_bytes(n.output, placements[n.name], mesh_shape)
              for n in trained_params(graph)]
    local = sum(blocks)
    link = _host(cluster, "host_link_bandwidth")
    if parameters:
        cost = _streamed_cost(local, max(blocks, default=0), optimizer_states, cluster,
                              devices_per_node, num_micro_batches, step_s)
        return replace(cost, device_window_bytes=float(sum(sorted(blocks)[-3:])))
    per_device_host = (1 + optimizer_states) * local
    per_node = per_device_host * devices_per_node
    step_bytes = (3 + 2 * optimizer_states) * local * devices_per_node
    return OffloadCost(link_s=2 * local / link,
                       host_step_s=step_bytes / _host(cluster, "host_memory_bandwidth"),
                       host_bytes_per_device=per_device_host, host_bytes_per_node=per_node,
                       host_memory_per_node=_host(cluster, "host_memory_per_node"))


def _streamed_cost(local: float, largest: float, optimizer_states: int, cluster,
                   devices_per_node: int, k: int, step_s: float) -> OffloadCost:
    """Parameters and gradients streamed per parameter (module docstring)."""
    link = _host(cluster, "host_link_bandwidth")
    up, down = k * local / link, k * local / link        # per phase: each block once
    hidden_forward, hidden_backward = step_s / 3, 2 * step_s / 3
    exposed = max(0.0, up - hidden_forward) + max(0.0, max(up, down) - hidden_backward) \
        + 3 * largest / link
    per_device_host = (2 + optimizer_states) * local
    return OffloadCost(
        link_s=exposed,
        host_step_s=(3 + 2 * optimizer_states) * local * devices_per_node
        / _host(cluster, "host_memory_bandwidth"),
        host_bytes_per_device=per_device_host,
        host_bytes_per_node=per_device_host * devices_per_node,
        host_memory_per_node=_host(cluster, "host_memory_per_node"), parameters=True,
        link_bytes_per_device=3 * k * local, device_window_bytes=3 * largest)


def streamed_floor_s(graph: OpGraph, optimizer_states: int, cluster, num_devices: int,
                     num_micro_batches: int) -> tuple[float, float]:
    """What every plan streaming parameters pays at least, in seconds: the host link up,
    which carries each parameter block twice per micro-batch (split over every device at
    best; the step takes at least this long), and the host's step after backward."""
    local = sum(n.output.nbytes for n in trained_params(graph)) / max(1, num_devices)
    per_node = min(num_devices, getattr(cluster, "devices_per_node", num_devices) or 1)
    up = 2 * num_micro_batches * local / _host(cluster, "host_link_bandwidth")
    host = (3 + 2 * optimizer_states) * local * per_node / _host(cluster,
                                                                 "host_memory_bandwidth")
    return up, host


def device_window_bytes(graph: OpGraph) -> float:
    """Bytes of streamed copies a device holds at once with parameters offloaded, at most
    (the three largest parameters whole; a plan's own blocks may be smaller)."""
    return float(sum(sorted(n.output.nbytes for n in trained_params(graph))[-3:]))


def host_floor_bytes(graph: OpGraph, optimizer_states: int, num_nodes: int,
                     parameters: bool = False) -> float:
    """Host bytes per node no offloading plan goes below: every parameter split over every
    device, its copy and states on the host (``parameters``: its gradient too)."""
    total = sum(n.output.nbytes for n in trained_params(graph))
    return (1 + int(parameters) + optimizer_states) * total / max(1, num_nodes)
