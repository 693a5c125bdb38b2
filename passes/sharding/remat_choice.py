"""Activation checkpointing as a planning decision: plan the step with and without it.

``remat="none"`` plans the step as captured, ``"full"`` the step whose blocks recompute
their forward in backward (``frontends/block_remat.py``), and ``"auto"`` plans both and keeps
the faster plan that fits: recomputation costs about one more forward of every block, and
pays where the activations it frees let the plan shard less (fewer collectives), hold more
micro-batches in flight, or fit at all. Both graphs are priced by the same cost model, the
rewritten one with its recompute ops in backward and its shorter activation lifetimes, so
the intra-op ILP and the stage DP see the choice in their own terms.

A capture is not planned at all when its compute alone cannot beat a plan already found
(``compute_lower_bound``: every flop spread perfectly over every device): on GPT-1.3B on
4 H100s the checkpointed step's extra forward puts its bound above the plain plan, and
its whole pipeline search (half of ``remat="auto"``'s time) is skipped with the same
answer.

The chosen mode is written into the plan (``plan.method["remat"]`` and a note), so the
runtime captures the same graph the plan was made for (``chosen_remat``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

__all__ = ["REMAT_MODES", "capture_modes", "plan_with_remat", "chosen_remat", "remat_note",
           "compute_lower_bound"]

from torchalpa.core.options import REMAT_MODES, check_remat, parse_remat
from torchalpa.passes.sharding.layer_remat import checkpointing_line

C = TypeVar("C")


def capture_modes(remat: str) -> tuple[str, ...]:
    """The captures a ``remat`` setting plans: one, or both for 'auto'."""
    check_remat(remat, "remat")
    return ("none", "full") if remat == "auto" else (remat,)


def remat_note(mode: str, graph) -> str:
    """One line for the plan summary: what checkpointing the plan runs and its cost."""
    info = graph.meta.get("remat") or {}
    if parse_remat(mode)[0] not in ("full", "selective"):
        return "activation checkpointing: none (forward's activations kept for backward)"
    kept = ", matrix products and attention kept" if mode.startswith("selective") else ""
    which = checkpointing_line(mode, info).removeprefix("checkpointing: ") + "; " \
        if parse_remat(mode)[1] is not None else ""
    return (f"activation checkpointing: {mode} ({which}{info.get('blocks', 0)} blocks "
            f"recompute {info.get('recomputed_ops', 0)} forward ops in backward{kept})")


def compute_lower_bound(graph, cluster, num_micro_batches: int = 1) -> float:
    """Seconds no plan of ``graph`` (one micro-batch) on ``cluster`` can beat under the
    cost model: every op's flops at its dtype's peak, split evenly over all devices, for
    every micro-batch. An op's modelled time is at least its share of flops at peak
    (``passes/pricing/cost.compute_cost``), a stage runs each of its micro-batches in turn, and
    the slowest stage's devices-weighted share is at least the average; 0 when the
    cluster has no compute figures."""
    mesh = cluster.logical_mesh()
    if mesh.peak_flops is None:
        return 0.0
    seconds = 0.0
    for node in graph.ops():
        dtype = next((s.dtype for s in node.outputs
                      if s.dtype.startswith(("float", "bfloat", "complex"))),
                     node.outputs[0].dtype if node.outputs else "")
        seconds += node.flops / mesh.peak_flops_for(dtype)
    return num_micro_batches * seconds / cluster.num_devices


def plan_with_remat(variants: dict[str, C], solve: Callable[[C], Any],
                    graph_of: Callable[[C], Any],
                    lower_bound: Callable[[C], float] | None = None) -> Any:
    """Solve each captured variant (mode -> capture) and keep the fastest feasible plan,
    marked with its mode. A variant that does not fit is skipped; if none fits, the error
    says why for each. ``lower_bound`` (capture -> seconds no plan of it beats, under
    the same estimate as the plans' ``step_time_s``) skips solving a variant that could
    not win against a plan already found (the first of equals wins, as without it)."""
    from torchalpa.passes.sharding.ilp import InfeasibleError
    plans: dict[str, Any] = {}
    failures: dict[str, Exception] = {}
    skipped: dict[str, float] = {}
    for mode, captured in variants.items():
        fitting = [p.estimates.step_time_s for p in plans.values() if _fits(p)]
        if lower_bound is not None and fitting:
            bound = lower_bound(captured)
            if bound >= min(fitting):
                skipped[mode] = bound
                continue
        try:
            plans[mode] = solve(captured)
        except InfeasibleError as e:
            failures[mode] = e
    if not plans:
        if len(failures) == 1:
            raise next(iter(failures.values()))
        raise InfeasibleError("no plan fits, with or without activation checkpointing:\n"
                              + "\n".join(f"  remat={m}: {e}" for m, e in failures.items()))
    best = min(plans, key=lambda m: plans[m].estimates.step_time_s)
    notes = [remat_note(best, graph_of(variants[best]))]
    if len(variants) > 1:
        tried = ", ".join(f"{m}: {plans[m].estimates.step_time_s * 1e3:.4g} ms"
                          if m in plans else
                          f"{m}: not planned, its compute alone takes {skipped[m] * 1e3:.4g} ms"
                          if m in skipped else f"{m}: does not fit" for m in variants)
        notes.append(f"remat='auto' chose {best!r} (estimated step: {tried})")
    plan = plans[best]
    return replace(plan, method={**plan.method, "remat": best},
                   notes=tuple(plan.notes) + tuple(notes))


def _fits(plan) -> bool:
    """Whether the plan's estimated peak is within the budget it records (when it records
    both): only such a plan may stop another capture from being planned."""
    peak = plan.estimates.memory_per_device_bytes
    budget = plan.estimates.memory_budget_per_device_bytes or \
        plan.estimates.memory_budget_bytes
    return peak is None or not budget or peak <= budget


def chosen_remat(plan) -> str:
    """The checkpointing mode a plan was made for ('none' for plans made before the choice
    existed)."""
    return plan.method.get("remat", "none")
