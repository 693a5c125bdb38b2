"""A checkpointing candidate of AutoParallel bounded by its views' linear relaxations.

The search's cheap bound (``passes/pricing/bounds.py``) prices every op at its roofline
over all devices: it counts a checkpointed block's recompute (the capture holds the
copies of the forward ops), but nothing a layout pays on top -- collectives, resharding,
work no layout splits evenly. On target a (LLaMA-3-8B, 1 x 8 H100) that leaves the
checkpointing candidates' bounds (2.3-2.5 s/step) under the plan in hand (2.632) by more
than the tolerance, so each was solved, for tens of seconds to minutes, to lose by 1-20 %.
The linear relaxation of each view's problem (``intra_op.step_time_lower_bound``, a few
seconds a view) prices those too: on that step it sits about 1 % under the estimate the
view's ILP finds where memory does not bind.

Why the least of the views' relaxations bounds the candidate's plan:

1. ``plan_graph`` returns the fastest of the plans found on the views it solves (by
   their estimated step). The views the search settles (``_Search.settled_views``) are
   not solved: one settled as not fitting gives no plan, one settled by dominance gives
   none either (by the search's rule it could not beat a plan in hand). So the
   candidate's plan, where it has one, comes from a view not settled.
2. Every plan ``plan_intra_op`` returns for a view has an estimated step at or above that
   view's ``step_time_lower_bound``: the bound is the optimum of the linear relaxation of
   the least simplified problem the view's ILP may solve (the shared and merged
   groupings, the memory rows, the search's gap, a start from a plan found before and
   the values read twice priced once per layout only restrict it or are priced at
   ``1/k`` of each of their ``k`` reads there), and a relaxation's optimum is at or below
   every integral point's objective.
3. So the candidate's estimate is at least the least bound over its views not settled.
   Where that least bound cannot beat the best plan in hand by more than the search's
   tolerance, the candidate is refused as its cheap bound would refuse it: the plan
   returned is the same as solving it gives, unless that plan came within the tolerance
   of the best, which the search's cheap bound already accepts.

A view with no such bound (``step_time_lower_bound`` returns None: no HiGHS, Alpa's
all-reduce combiner lowering the step after the solve) gives no bound: the candidate is
solved. The views are bounded 2-D first (where the plans are and the bounds lowest) and
the first bound that lets the candidate through stops the rest: a candidate that is
solved anyway pays one or two LPs, a few percent of its solves.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import ShardParallel

__all__ = ["views_bound"]


def views_bound(graph: OpGraph, meshes: list[LogicalMesh], method: ShardParallel, *,
                inputs: str = "global", memo=None, blocks: dict | None = None,
                skip: Collection[int] = (), below: float = -math.inf) -> float | None:
    """The least ``step_time_lower_bound`` of ``graph`` over ``meshes`` but those whose
    index is in ``skip``: no plan ``plan_graph`` finds on those views has a lower estimate.
    None where a view has no bound or none is left (a view whose relaxation has no
    feasible point has no plan either: it is passed over). Stops at the first view whose
    bound is below ``below`` and returns that bound (the least is then at most it): the
    caller compares the answer with ``below`` only (default: every view bounded).
    ``memo``, ``blocks``: ``plan_intra_op``'s."""
    from torchalpa.passes.sharding.ilp import InfeasibleError
    from torchalpa.passes.sharding.intra_op import step_time_lower_bound
    views = sorted((i for i in range(len(meshes)) if i not in skip),
                   key=lambda i: (-len(meshes[i].shape), i))
    least = math.inf
    for i in views:
        try:
            bound = step_time_lower_bound(graph, meshes[i], method, inputs=inputs,
                                          memo=memo, blocks=blocks)
        except InfeasibleError:     # not even its relaxation has a plan: the view none
            continue
        if bound is None:
            return None
        least = min(least, bound)
        if bound < below:
            break
    return least if math.isfinite(least) else None
