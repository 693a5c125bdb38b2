"""Checkpointing per layer: how many blocks recompute, chosen by the memory they free.

Checkpointing every block (``remat="full"``) frees most of the activations a step keeps
for backward and costs one more forward of every block; keeping them all (``"none"``)
costs nothing and may not fit. In between, ``"full:k"`` checkpoints the first k of the
step's L blocks (``frontends/block_remat.py``) and keeps the others'. The blocks of a
transformer are alike, so each frees about the same bytes and costs about the same
recompute: the cheapest plan that fits checkpoints the fewest blocks that free enough (a
knapsack of equal items is solved greedily), and the first ones, since in a pipeline the
first stages hold the most micro-batches in flight (1F1B), which is where Mist
checkpoints too.

The planner (``torchalpa/parallel/auto.py``) derives the per-block figures from the one
capture's bounds (``passes/pricing/bounds.py``: memory with every block kept and with every block
checkpointed, each split over every device), proposes the smallest k whose bound fits
the budget and a few larger ones (a bound is optimistic: the plan that is solved may need
more), and solves them as candidates like any other, so the ILP and the stage search
price each with its own recompute ops and activation lifetimes.
"""

from __future__ import annotations

import math

from torchalpa.core.options import parse_remat

__all__ = ["block_counts", "checkpointing_line", "more_recompute"]

STEPS = 2
"""Block counts proposed above the smallest one whose bound fits (evenly towards L)."""


def block_counts(total: int, none_bytes: float, full_bytes: float, budget: float,
                 steps: int = STEPS) -> list[int]:
    """Block counts k (0 < k < total) worth planning as ``full:k``: the smallest whose
    memory bound fits ``budget`` -- every block freeing ``(none_bytes - full_bytes) /
    total`` of the uncheckpointed bound ``none_bytes`` -- and ``steps`` more evenly
    spaced towards ``total``. Empty when there is nothing between the uniform choices
    (no blocks, checkpointing frees nothing, or even every block does not fit)."""
    per_block = (none_bytes - full_bytes) / total if total else 0.0
    if total < 2 or per_block <= 0 or full_bytes > budget:
        return []
    smallest = max(1, math.ceil((none_bytes - budget) / per_block)) if none_bytes > budget \
        else 1
    if smallest >= total:
        return []
    counts = {smallest + math.ceil(j * (total - smallest) / (steps + 1))
              for j in range(steps + 1)}
    return sorted(k for k in counts if 0 < k < total)


def checkpointing_line(mode: str, info: dict) -> str:
    """The plan summary's line: which blocks recompute, e.g. "checkpointing: blocks 0-4
    of 12 (full), 5-11 none"."""
    policy, first = parse_remat(mode)
    total = info.get("of") or info.get("blocks", 0)
    if policy == "none" or not total:
        return "checkpointing: none (forward's activations kept for backward)"
    k = total if first is None else min(first, total)
    rest = f", {k}-{total - 1} none" if k < total else ""
    done = f"blocks 0-{k - 1}" if k else "no blocks"
    return f"checkpointing: {done} of {total} ({policy}){rest}"


def more_recompute(a: str, b: str, total: int | None = None) -> bool:
    """Whether mode ``b`` recomputes at least what ``a`` does: a policy at least as
    heavy (none < selective < full) on at least as many of the first blocks."""
    level = {"none": 0, "selective": 1, "full": 2}
    (pa, ka), (pb, kb) = parse_remat(a), parse_remat(b)
    big = math.inf if total is None else total
    ka = 0 if pa == "none" else big if ka is None else ka
    kb = 0 if pb == "none" else big if kb is None else kb
    return ka == 0 or (level[pa] <= level[pb] and ka <= kb)
