"""Views (logical meshes) of an intra-op candidate that their LP bounds rule out unsolved.

AutoParallel solves each intra-op candidate's ILP on every view of the cluster. Once a plan
is in hand, a view whose plan cannot beat it by more than the search's tolerance need not
be solved: ``passes/sharding/intra_op.step_time_lower_bound`` (the linear relaxation of
the problems its ILP solves, with the memory rows every fitting plan meets) says what no
plan of that view goes below. The relaxations of a candidate's views run at once in forked
processes, one per core, as its ILPs do; each is bounded by work, so which views are cut
depends on the model and the plan in hand, never on the machine's load.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import ShardParallel

__all__ = ["ViewBound", "view_bounds", "cut_views", "LP_CUT"]

LP_CUT = "its LP bound "
"""How the reason a view was cut by its bound begins (the search counts them in notes)."""


@dataclass(frozen=True)
class ViewBound:
    """What the relaxation says of one view: seconds per step no plan of it goes below
    (None: no bound -- no HiGHS, or the relaxation found no point within the budget,
    which the view's ILP then proves or refutes: a cut is never made on a solver's
    status alone)."""

    view: int
    seconds: float | None


def view_bounds(graph: OpGraph, meshes: list[LogicalMesh], views: list[int],
                method: ShardParallel, *, inputs: str, blocks: dict | None, memo=None,
                workers: int = 1) -> list[ViewBound]:
    """The bound of each view of ``views`` (indices into ``meshes``) for ``graph`` planned
    by ``method`` (``blocks``: the repeated layers its ILPs share decisions across), in up
    to ``workers`` forked processes."""
    from torchalpa.passes.pipeline_search.stage_jobs import fork_map
    from torchalpa.passes.sharding.ilp import InfeasibleError
    from torchalpa.passes.sharding.intra_op import step_time_lower_bound

    def bound(i: int) -> ViewBound:
        try:
            return ViewBound(i, step_time_lower_bound(graph, meshes[i], method, inputs=inputs,
                                                      memo=memo, blocks=blocks))
        except InfeasibleError:
            return ViewBound(i, None)

    return fork_map(bound, list(views), workers)


def cut_views(bounds: list[ViewBound], best_s: float, tolerance: float
              ) -> dict[int, tuple[str, bool]]:
    """View index -> (why it is not solved, True: it may fit) for each view of ``bounds``
    that cannot beat ``best_s`` (the best plan's estimate) by more than ``tolerance``: the
    rule the search cuts whole candidates by (``solve_in_order``)."""
    return {b.view: (f"{LP_CUT}{b.seconds * 1e3:.4g} ms/step cannot beat "
                     f"{best_s * 1e3:.4g} by the tolerance", True)
            for b in bounds if b.seconds is not None and b.seconds * (1 + tolerance) >= best_s}
