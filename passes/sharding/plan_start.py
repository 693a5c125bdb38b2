"""A plan found before on the same graph and view, as the ILP's starting incumbent.

AutoParallel solves a tight candidate's ILPs to within its tolerance and then re-solves the
views that could win at the solver's own gap (``parallel/auto.py``, ``_Search.polish``). The
re-solve is the same problem -- graph, view, memory budget -- but for the gap (and the values
read twice alike that later candidates found, priced once), so the plan the first solve
found is a feasible point of it (a start that no longer fits is one HiGHS rejects).
Handed to HiGHS as its incumbent (``ilp_highs.solve_with_highs``' partial start) it lets the
solver stop once its bound meets that plan instead of running its heuristics to find one
(target a's runs all end at the root node). What the solver guarantees does not change:
it stops when its bound is within the gap of its best plan, wherever that plan came from, so
the re-solve is still optimal to the solver's gap; where plans tie within that gap, which of
them it returns may differ from a cold solve. Work decides, not a clock: the same start gives
the same plan on any machine.
"""

from __future__ import annotations

from torchalpa.core.plan import Plan
from torchalpa.passes.sharding.strategies import Strategy

__all__ = ["start_choice"]


def start_choice(plan: Plan, strategies: dict[str, list[Strategy]]) -> dict[str, Strategy]:
    """node -> the first of ``strategies[node]`` that reads and writes the layouts ``plan``
    gives that node. Nodes without such a strategy are left out (the solver completes the
    rest): a plan's gradients may be rewritten after its ILP (scattered, their all-reduces
    merged), and a start that no longer fits the budget is only a start HiGHS rejects."""
    choice: dict[str, Strategy] = {}
    for placed in plan.strategies:
        for s in strategies.get(placed.node, ()):
            if s.inputs == placed.inputs and s.outputs == placed.outputs:
                choice[placed.node] = s
                break
    return choice
