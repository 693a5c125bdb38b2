"""Views (logical meshes) of an intra-op candidate that their LP bounds rule out unsolved.

AutoParallel solves each intra-op candidate's ILP on every view of the cluster. Once a plan
is in hand, a view whose plan cannot beat it by more than the search's tolerance need not
be solved: ``passes/sharding/intra_op.step_time_lower_bound`` (the linear relaxation of
the problems its ILP solves, with the memory rows every fitting plan meets) says what no
plan of that view goes below. The bound is taken where the view would be solved
(``shard.plan_graph(cutoff=)``: in the forked worker, before its ILP), on the strategies
and prices the solve then reuses, so a view that is not cut pays only the LP (a fraction
of its solve) and a cut one pays its pricing and the LP instead of its solve. The plan in
hand is the best of the candidates solved before (``Cutoff``): fixed before the views are
forked, so which views are cut depends on the model and the search's order, never on
which worker finished first or the machine's load.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import ShardParallel

__all__ = ["ViewBound", "Cutoff", "ViewsCut", "bound_view", "cut_views", "LP_CUT"]

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


@dataclass(frozen=True)
class Cutoff:
    """The plan a view's ILP must beat to be worth solving: the best estimate in hand
    (``best_s``, seconds per step, from candidates solved before) and the search's
    ``tolerance`` (a view that could win only by less is not solved, the rule whole
    candidates are cut by in ``auto._Search.solve_in_order``)."""

    best_s: float
    tolerance: float

    def cuts(self, bound: ViewBound) -> bool:
        """Whether ``bound`` proves its view cannot beat ``best_s`` by the tolerance."""
        return bound.seconds is not None and \
            bound.seconds * (1 + self.tolerance) >= self.best_s

    def why(self, bound: ViewBound) -> str:
        """Why a view ``cuts`` says is cut is not solved (begins with ``LP_CUT``)."""
        assert bound.seconds is not None, "a view without a bound is never cut"
        return (f"{LP_CUT}{bound.seconds * 1e3:.4g} ms/step cannot beat "
                f"{self.best_s * 1e3:.4g} by the tolerance")


class ViewsCut(Exception):
    """No view of the graph was planned: the views not cut by their LP bounds (``cut``,
    view index -> its bound) were skipped, refused by the memory bound or do not fit, so
    no plan of it can beat the ``Cutoff``. Not an ``InfeasibleError``: the candidate may
    fit; it cannot win."""

    def __init__(self, cut: dict[int, ViewBound], cutoff: Cutoff):
        super().__init__(f"every view is cut by its LP bound or does not fit ({len(cut)} "
                         f"cut, against {cutoff.best_s:.4g} s/step)")
        self.cut, self.cutoff = cut, cutoff


def bound_view(graph: OpGraph, mesh: LogicalMesh, view: int, method: ShardParallel, *,
               inputs: str, blocks: dict | None, memo=None) -> ViewBound:
    """The bound of view ``view`` (``mesh``) for ``graph`` planned by ``method``
    (``blocks``: the repeated layers its ILPs share decisions across); ``memo``: the
    pricing the view's solve then reuses (``plan_intra_op``'s)."""
    from torchalpa.passes.sharding.ilp import InfeasibleError
    from torchalpa.passes.sharding.intra_op import step_time_lower_bound
    try:
        return ViewBound(view, step_time_lower_bound(graph, mesh, method, inputs=inputs,
                                                     memo=memo, blocks=blocks))
    except InfeasibleError:
        return ViewBound(view, None)


def cut_views(bounds: list[ViewBound], cutoff: Cutoff) -> dict[int, tuple[str, bool]]:
    """View index -> (why it is not solved, True: it may fit) for each view of ``bounds``
    that ``cutoff`` cuts."""
    return {b.view: (cutoff.why(b), True) for b in bounds if cutoff.cuts(b)}
