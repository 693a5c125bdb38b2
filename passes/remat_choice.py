"""Activation checkpointing as a planning decision: plan the step with and without it.

``remat="none"`` plans the step as captured, ``"full"`` the step whose blocks recompute
their forward in backward (``frontends/checkpoint.py``), and ``"auto"`` plans both and keeps
the faster plan that fits: recomputation costs about one more forward of every block, and
pays where the activations it frees let the plan shard less (fewer collectives), hold more
micro-batches in flight, or fit at all. Both graphs are priced by the same cost model, the
rewritten one with its recompute ops in backward and its shorter activation lifetimes, so
the intra-op ILP and the stage DP see the choice in their own terms.

The chosen mode is written into the plan (``plan.method["remat"]`` and a note), so the
runtime captures the same graph the plan was made for (``chosen_remat``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, TypeVar

__all__ = ["REMAT_MODES", "capture_modes", "plan_with_remat", "chosen_remat", "remat_note"]

REMAT_MODES = ("none", "full", "auto")

C = TypeVar("C")


def capture_modes(remat: str) -> tuple[str, ...]:
    """The captures a ``remat`` setting plans: one, or both for 'auto'."""
    if remat not in REMAT_MODES:
        raise ValueError(f"remat must be one of {REMAT_MODES}, got {remat!r}")
    return ("none", "full") if remat == "auto" else (remat,)


def remat_note(mode: str, graph) -> str:
    """One line for the plan summary: what checkpointing the plan runs and its cost."""
    info = graph.meta.get("remat") or {}
    if mode != "full":
        return "activation checkpointing: none (forward's activations kept for backward)"
    return (f"activation checkpointing: full ({info.get('blocks', 0)} blocks recompute "
            f"{info.get('recomputed_ops', 0)} forward ops in backward)")


def plan_with_remat(variants: dict[str, C], solve: Callable[[C], Any],
                    graph_of: Callable[[C], Any]) -> Any:
    """Solve each captured variant (mode -> capture) and keep the fastest feasible plan,
    marked with its mode. A variant that does not fit is skipped; if none fits, the error
    says why for each."""
    from torchalpa.passes.ilp import InfeasibleError
    plans: dict[str, Any] = {}
    failures: dict[str, Exception] = {}
    for mode, captured in variants.items():
        try:
            plans[mode] = solve(captured)
        except InfeasibleError as e:
            failures[mode] = e
    if not plans:
        if len(failures) == 1:
            raise next(iter(failures.values()))
        raise InfeasibleError("no plan fits, with or without activation checkpointing:\n"
                              + "\n".join(f"  remat={m}: {e}" for m, e in failures.items()))
    best = min(plans, key=lambda m: plans[m].estimates["step_time_s"])
    notes = [remat_note(best, graph_of(variants[best]))]
    if len(variants) > 1:
        tried = ", ".join(f"{m}: {plans[m].estimates['step_time_s'] * 1e3:.4g} ms"
                          if m in plans else f"{m}: does not fit" for m in variants)
        notes.append(f"remat='auto' chose {best!r} (estimated step: {tried})")
    plan = plans[best]
    return replace(plan, method={**plan.method, "remat": best},
                   notes=tuple(plan.notes) + tuple(notes))


def chosen_remat(plan) -> str:
    """The checkpointing mode a plan was made for ('none' for plans made before the choice
    existed)."""
    return plan.method.get("remat", "none")
