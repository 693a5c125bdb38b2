"""Offloaded optimizer states in a plan: their price added, the hosts' memory checked.

A plan made with ``AutoShardingOption.offload`` counts no optimizer state on the devices;
``with_offload`` adds what the offload costs (``passes/pricing/offload_price.py``) to its step and
states the host memory it takes, for ``ShardParallel`` and for ``AutoParallel``'s intra-op
candidates alike. ``host_memory_shortfall`` says, in one line, why the hosts refuse a job whose states cannot
fit the hosts even split over every device.
"""

from __future__ import annotations

import math
from dataclasses import replace

from torchalpa.core.options import OPTIMIZER_STATES
from torchalpa.core.units import format_bytes

__all__ = ["with_offload", "host_memory_shortfall", "offloads_parameters",
           "with_streaming_room"]


def with_offload(plan, graph, cluster, method):
    """``plan`` (intra-op, made with optimizer states off the devices) with the offload's
    price added to its step and its host memory stated (``passes/pricing/offload_price.py``); an
    InfeasibleError when the host cannot hold the states. With parameters offloaded, its
    device memory and budget both count the streamed copies in flight (the plan was solved
    for the budget less the room ``with_streaming_room`` keeps for them)."""
    from torchalpa.passes.pricing.offload_price import device_window_bytes, offload_cost
    from torchalpa.passes.sharding.ilp import InfeasibleError
    per_node = getattr(cluster, "devices_per_node", plan.num_devices)
    parameters = offloads_parameters(method)
    est = plan.estimates
    cost = offload_cost(graph, {p.node: p.placements for p in plan.parameters},
                        plan.mesh_shape, OPTIMIZER_STATES[method.optimizer], cluster,
                        min(per_node, plan.num_devices), parameters=parameters,
                        num_micro_batches=plan.method.get("num_micro_batches") or 1,
                        step_s=est.step_time_s or 0.0)
    if not cost.fits:
        raise InfeasibleError(
            f"offloaded optimizer states need {format_bytes(cost.host_bytes_per_node)} of "
            f"host memory per node in this plan, the nodes have "
            f"{format_bytes(cost.host_memory_per_node)}: parameters split over more devices "
            "or hosts with more memory would fit")
    memory, budget = est.memory_per_device_bytes, est.memory_budget_per_device_bytes
    if parameters and memory is not None:      # the streamed copies in flight
        memory += cost.device_window_bytes
    if parameters and budget is not None:      # solved for the budget less the room kept
        budget += device_window_bytes(graph)   # for those copies: the whole one again
    estimates = replace(est, step_time_s=est.step_time_s + cost.seconds,
                        once_per_step_s=(est.once_per_step_s or 0) + cost.seconds,
                        offload_s=cost.seconds, host_bytes_per_node=cost.host_bytes_per_node,
                        memory_per_device_bytes=memory, memory_budget_per_device_bytes=budget,
                        streamed_bytes_per_device=cost.device_window_bytes if parameters
                        else None)
    flags = {"offload": True, **({"offload_parameters": True} if parameters else {})}
    return replace(plan, estimates=estimates, method={**plan.method, **flags},
                   notes=tuple(plan.notes) + (cost.note(),))


def with_streaming_room(method, graph, cluster):
    """``method`` whose memory budget leaves room for the parameter copies in flight
    (``offload_price.device_window_bytes``), where a budget is known."""
    from torchalpa.passes.pricing.offload_price import device_window_bytes
    option = method.auto_sharding_option
    whole = option.memory_budget_per_device or getattr(cluster, "memory_per_device", None)
    if not whole:
        return method
    return replace(method, auto_sharding_option=replace(
        option, memory_budget_per_device=whole - device_window_bytes(graph)))


def offloads_parameters(method) -> bool:
    """Whether ``method`` (AutoParallel or a concrete method) offloads parameters too."""
    option = getattr(method, "auto_sharding_option", None)
    return getattr(method, "offload", None) == "parameters" or \
        bool(getattr(option, "offload_parameters", False))


def host_memory_shortfall(graph, cluster, method, why: str = "") -> str | None:
    """One line when even optimizer states split over every device exceed the hosts'
    memory (what they need and what would hold them), else None."""
    from torchalpa.passes.pricing.offload_price import DEFAULT_HOST, host_floor_bytes
    nodes = getattr(cluster, "num_nodes", 1)
    have = getattr(cluster, "host_memory_per_node", DEFAULT_HOST["host_memory_per_node"])
    parameters = offloads_parameters(method)
    need = host_floor_bytes(graph, OPTIMIZER_STATES[method.optimizer], nodes, parameters)
    if need <= have:
        return None
    nodes_needed = math.ceil(need * nodes / have) if have else "more"
    what = "the parameters, gradients and optimizer states" if parameters else \
        "the optimizer states"
    return ((f"{why}; " if why else "") + f"offloading {what} to host memory "
            f"needs at least {format_bytes(need)} per node (parameter copies"
            f"{', gradients' if parameters else ''} and {method.optimizer} states), the nodes "
            f"have {format_bytes(have)}: use hosts with {format_bytes(need)} or "
            f"{nodes_needed} nodes")
