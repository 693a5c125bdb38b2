"""Reads of one value in one layout are priced once (passes/sharding/shared_reshard.py), and a
plan's shared read round-trips through JSON."""

import numpy as np
import pytest

from torchalpa.core.placement import Partial, Replicate
from torchalpa.core.plan import Reshard, ReshardStep
from torchalpa.passes.sharding.ilp import Edge, ILPProblem, solve_ilp
from torchalpa.passes.sharding.shared_reshard import SharedReads

# producer u writes layout A (strategy 0) or B (strategy 1); targets X (0) and Y (1)
TABLE = np.array([[10.0, 6.0],       # A -> X, A -> Y
                  [np.inf, 50.0]])   # B -> X impossible, B -> Y


def _problem(shared: bool) -> ILPProblem:
    """v1 can only read X; v2 reads X or Y. Priced per read, v2 reads Y (10 + 6);
    priced once per layout, v2 reads X too and pays nothing more (10)."""
    costs = {"u": np.zeros(2), "v1": np.zeros(1), "v2": np.zeros(2)}
    rows = np.array([0, 1])
    reads = [("v1", np.array([0])), ("v2", np.array([0, 1]))]
    if shared:
        return ILPProblem(node_costs=costs, shared=[SharedReads(("u", 0), "u", rows, reads,
                                                                TABLE)])
    edges = [Edge("u", v, rows, targets, TABLE) for v, targets in reads]
    return ILPProblem(node_costs=costs, edges=edges)


@pytest.mark.parametrize("solver", ["cbc", "highs"])    # one model, written for either solver
def test_reads_alike_are_priced_once(solver):
    per_read = solve_ilp(_problem(shared=False), solver=solver)
    assert per_read.objective == pytest.approx(16.0)
    assert per_read.choice == {"u": 0, "v1": 0, "v2": 1}
    once = solve_ilp(_problem(shared=True), solver=solver)
    assert once.objective == pytest.approx(10.0)
    assert once.choice == {"u": 0, "v1": 0, "v2": 0}


def test_a_shared_read_round_trips():
    step = ReshardStep("all_reduce", 0, 64, (Partial(),), (Replicate(),), reduce_op="sum")
    first = Reshard("conv", 0, "bn", 0, (step,))
    second = Reshard("conv", 0, "bn_backward", 1, (), same_as=("bn", 0))
    for r in (first, second):
        assert Reshard.from_dict(r.to_dict()) == r
    assert "same_as" not in first.to_dict()
