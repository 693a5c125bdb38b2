"""A job no plan can fit, told before anything is traced: the model states' floor.

Every plan ``AutoParallel`` can return holds each trained parameter, its gradient and the
optimizer's states somewhere for the whole step. On the devices, the most any candidate
splits them is over every device (ZeRO-3 over the whole cluster; pipeline stages whose
devices together hold one copy), so some device holds at least their total over the
device count, before any activation (``passes/pricing/bounds.StepProfile.memory_bytes``
bounds every candidate by the same term). Offloading (``AutoParallel.offload``) moves the
optimizer states -- and as a last resort the parameters and gradients -- to host memory,
where each node holds at least its share of the parameter copies and states
(``passes/pricing/offload_price.host_floor_bytes``, the figure the search's own host check
refuses by). Where the devices cannot hold the states and the hosts cannot hold what
offloading puts there (or offloading is not weighed), no candidate fits -- and capturing
the step first (minutes for a 405B model) would only say so later. ``states_refusal``
says it from the model's parameters alone, in well under a second, with what would fit.

The figures are read from the module the search traces (under a mixed-precision wrapper,
the float32 parameters the optimizer updates) as the capture lays them out: a parameter
that requires grad counts as trained, with its gradient and optimizer states, as the
capture counts every parameter the loss reaches. One that requires grad but that the
loss never reaches gets no gradient in the step, so a model holding many such parameters
could be refused where a plan fits: freeze those with ``requires_grad_(False)``. Buffers
and frozen parameters are not counted (a floor may leave things out, never add them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchalpa.core.options import OPTIMIZER_STATES, AutoParallel
from torchalpa.core.units import format_bytes, format_count

__all__ = ["ModelStates", "Mode", "modes", "states_refusal"]


@dataclass(frozen=True)
class ModelStates:
    """The trained parameters of a model, as stored, and the optimizer states per
    parameter element (``OPTIMIZER_STATES``)."""

    count: int               # trained parameter elements
    bytes: float             # their bytes as stored
    dtypes: tuple[str, ...]  # their dtypes, for the message
    optimizer: str
    optimizer_states: int

    @classmethod
    def of(cls, model: torch.nn.Module, optimizer: str) -> ModelStates:
        """Every parameter of ``model`` that requires grad (tied ones once)."""
        trained = [p for p in model.parameters() if p.requires_grad]
        return cls(count=sum(p.numel() for p in trained),
                   bytes=float(sum(p.numel() * p.element_size() for p in trained)),
                   dtypes=tuple(sorted({str(p.dtype).removeprefix("torch.")
                                        for p in trained})),
                   optimizer=optimizer, optimizer_states=OPTIMIZER_STATES[optimizer])

    @property
    def on_devices(self) -> float:
        """Bytes of the parameters, their gradients and optimizer states together."""
        return (2 + self.optimizer_states) * self.bytes

    def on_host(self, num_nodes: int, parameters: bool) -> float:
        """Bytes per node offloading needs at least (``host_floor_bytes``): the parameter
        copies and optimizer states, and with ``parameters`` the gradients too."""
        return (1 + int(parameters) + self.optimizer_states) * self.bytes / max(1, num_nodes)


@dataclass(frozen=True)
class Mode:
    """One way the search may hold the states, and what it needs: (where, bytes it needs
    at least there, bytes there are) for each place."""

    name: str
    needs: tuple[tuple[str, float, float], ...]

    def short(self) -> tuple[str, float, float] | None:
        """The first place that cannot hold its part, or None where all can."""
        return next((n for n in self.needs if n[1] > n[2]), None)


def modes(states: ModelStates, method: AutoParallel, cluster, budget: float) -> list[Mode]:
    """The ways ``method`` may hold the states, as ``AutoParallel``'s search tries them
    (``_Search.run``): on the devices; then, where it weighs offloading
    (``AutoParallel.weighs_offload``), the optimizer states in host memory (parameters and gradients stay on the
    devices: the memory model's 2 copies); then parameters and gradients there too.
    ``offload=True`` / ``'parameters'`` fix one of the last two, ``False`` the first."""
    from torchalpa.passes.pricing.offload_price import DEFAULT_HOST
    devices, nodes = cluster.num_devices, getattr(cluster, "num_nodes", 1)
    host = getattr(cluster, "host_memory_per_node", DEFAULT_HOST["host_memory_per_node"])
    per_device = f"per device over all {devices}"
    per_node = f"per node over {nodes}" if nodes > 1 else "on the host"
    out = []
    if method.offload in (None, False):
        out.append(Mode("on the devices", (
            (per_device, states.on_devices / devices, budget),)))
    weighed = method.weighs_offload
    if weighed or method.offload is True:
        out.append(Mode("optimizer states in host memory", (
            (per_device + " (parameters and gradients)", 2 * states.bytes / devices, budget),
            (per_node + " (parameter copies and optimizer states)",
             states.on_host(nodes, False), host))))
    if weighed or method.offload == "parameters":
        out.append(Mode("parameters, gradients and optimizer states in host memory", (
            (per_node, states.on_host(nodes, True), host),)))
    return out


def states_refusal(model: torch.nn.Module, method: AutoParallel, cluster) -> str | None:
    """Why no plan of ``method`` (an ``AutoParallel``) can fit ``model``'s states on
    ``cluster`` (a ``Cluster`` or ``LogicalMesh``), with what would fit; None where some
    way of holding them leaves room (the search decides then). Sound: it refuses only
    where every way the search weighs needs more than there is."""
    budget = method.auto_sharding_option.memory_budget_per_device or \
        getattr(cluster, "memory_per_device", None)
    if not budget or math.isinf(budget):
        return None
    states = ModelStates.of(model, method.optimizer)
    tried = modes(states, method, cluster, budget)
    if any(mode.short() is None for mode in tried):
        return None
    return _message(states, method, cluster, budget, tried)


def _message(states: ModelStates, method: AutoParallel, cluster, budget: float,
             tried: list[Mode]) -> str:
    """What no plan can fit, each way of holding the states with what it lacks, and what
    would fit."""
    devices, nodes = cluster.num_devices, getattr(cluster, "num_nodes", 1)
    dtype = "/".join(states.dtypes) or "no dtype"
    lines = [f"no way to run this step fits {format_bytes(budget)} per device on {devices} "
             f"devices ({nodes} node(s)): the model states alone -- "
             f"{format_count(states.count)} trained parameters ({format_bytes(states.bytes)} "
             f"in {dtype}), their gradients and {method.optimizer}'s "
             f"{states.optimizer_states} states per parameter, "
             f"{format_bytes(states.on_devices)} -- do not fit, before any activation "
             "(checked before tracing the step); tried:"]
    for mode in tried:
        where, need, have = mode.short() or ("", 0.0, 0.0)
        lines.append(f"  {mode.name}: needs at least {format_bytes(need)} {where}, has "
                     f"{format_bytes(have)}")
    if method.offload is None and method.pipeline is True and states.optimizer_states:
        lines.append("  host memory: not weighed (AutoParallel(pipeline=True): offloading is "
                     "planned for intra-op plans only)")
    elif method.offload is False and states.optimizer_states:
        lines.append("  host memory: not weighed (AutoParallel(offload=False))")
    lines.append("  (each holds for every candidate: intra-op or pipeline, any activation "
                 "checkpointing, any micro-batch count; no candidate was traced or solved)")
    would = []
    if method.offload in (None, False):
        would.append(f"at least {math.ceil(states.on_devices / budget)} devices of "
                     f"{format_bytes(budget)} (the states alone: activations need more)")
    host_modes = [m for m in tried if m.name != "on the devices"]
    if host_modes:       # the one needing least of the devices: the last the search tries
        mode = host_modes[-1]
        _, need, have = mode.needs[-1]
        devices_too = [f"at least {math.ceil(n * devices / budget)} devices of "
                       f"{format_bytes(budget)}" for _, n, _ in mode.needs[:-1]]
        would.append(f"{mode.name}: " + " and ".join(devices_too + [
            f"hosts with at least {format_bytes(need * nodes)} in all"
            + (f" ({math.ceil(need * nodes / have)} nodes like these)" if have else "")]))
    lines.append("what would fit: " + "; or ".join(would + [
        "a smaller model, or an optimizer with fewer states"]))
    return "\n".join(lines)
