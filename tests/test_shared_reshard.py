"""Reads of one value in one layout are priced once (passes/sharding/shared_reshard.py), a
plan's shared read round-trips through JSON, and a parameter's gathered copy that forward
and backward share counts in the plan's memory while it lives."""

import numpy as np
import pytest
import torch
import torch.nn as nn
from alpa_cases import plan_of

from torchalpa import Zero2Parallel
from torchalpa.core.placement import Partial, Replicate
from torchalpa.core.plan import Reshard, ReshardStep
from torchalpa.passes.pricing.memory import KeptTerm
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


class _NormedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(64, 64), nn.LayerNorm(64)

    def forward(self, x):
        return self.ln(self.fc(x))


def test_a_gathered_weight_shared_by_forward_and_backward_counts_in_memory():
    """ZeRO-2 on 4 devices gathers the layer norm's weight and bias once; forward and
    backward read that copy, so it is alive from the forward layer norm to its backward
    (64 floats each, whole on every device). Gathered again in backward
    (``rematerialize_parameters``) nothing is kept: with the same layouts, what forward
    leaves for backward differs by exactly the two kept copies."""
    batch = (torch.randn(32, 64), torch.randn(32, 64))
    kept, again = (plan_of(_NormedLinear, batch, shape=(1, 4), method=Zero2Parallel,
                           rematerialize_parameters=r)[0] for r in (False, True))
    assert kept.strategies == again.strategies
    shared = [r for r in kept.reshards if r.same_as is not None]
    assert sorted(r.same_as for r in shared) == [("native_layer_norm", 1),
                                                 ("native_layer_norm", 2)]
    assert not any(r.same_as for r in again.reshards)
    copies = 2 * 64 * 4
    assert kept.estimates.saved_activation_bytes_per_device == \
        again.estimates.saved_activation_bytes_per_device + copies


def _kept_problem(budget: float | None, same_reader: bool = False) -> ILPProblem:
    """A parameter ``p`` stored split (strategy 0: 10 bytes of state) or whole (1: 40
    bytes, and 20 to keep whole), read by ``a`` and ``b`` whole (0) or split (1, 5 each).
    Stored split and read whole by both, one gathered copy of 40 bytes lives between
    the reads. ``same_reader``: both reads are ``a``'s (two operands of one node, or
    readers grouped under one representative): its columns appear twice in the bound."""
    costs = {"p": np.array([0.0, 20.0]), "a": np.array([0.0, 5.0]), "b": np.array([0.0, 5.0])}
    whole = np.array([True, False])
    term = KeptTerm("p", whole, (("a", whole, "a" if same_reader else "b", whole),), 40.0)
    return ILPProblem(node_costs=costs, memory_terms=[{"p": np.array([10.0, 40.0])}],
                      memory_kept=[[term]], memory_budget=budget)


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_the_ilp_counts_a_kept_copy_only_when_three_choices_make_it(solver):
    """The copy's bound ``y >= x_p + x_a + x_b - 2`` binds only when all three choose it:
    under 45 bytes the ILP reads the parameter split once (5) rather than keep the copy
    (10 + 40 bytes) or store it whole (20); the readers' dominated strategies survive
    presolve."""
    free = solve_ilp(_kept_problem(None), solver=solver)
    assert free.objective == pytest.approx(0.0)
    assert free.choice == {"p": 0, "a": 0, "b": 0}
    tight = solve_ilp(_kept_problem(45.0), solver=solver)
    assert tight.objective == pytest.approx(5.0)
    assert tight.choice["p"] == 0 and tight.choice["a"] + tight.choice["b"] == 1
    # one reader twice: its column enters the bound once, with coefficient 2 (HiGHS
    # refuses a row naming a column twice, and then solved a model without rows)
    once = solve_ilp(_kept_problem(45.0, same_reader=True), solver=solver)
    assert once.objective == pytest.approx(5.0)
    assert once.choice == {"p": 0, "a": 1, "b": 0}


class _TwoConvs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(64, 64, 3, padding=1), nn.Conv2d(64, 64, 3, padding=1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_tight_budget_counts_the_kept_copies():
    """The ILP's memory rows count ZeRO-2's kept copies (``KeptTerm``: the parameter's
    layout and two readers' layouts decide whether one is kept), so a plan under a
    budget that binds stays within it. A convolution reads its weight directly, forward
    and backward, so the gathered copy they share is no view the activations already
    count: before these terms the planner returned a plan of 1,491,460 bytes per device
    for this 1,400,000-byte budget."""
    batch = (torch.randn(32, 64, 8, 8), torch.randn(32, 64, 8, 8))
    budget = 1_400_000

    def planned(**options):
        return plan_of(_TwoConvs, batch, shape=(1, 4), method=Zero2Parallel,
                       force_batch_dim_to_mesh_dim=None, **options)[0]

    free = planned()
    assert any(r.same_as for r in free.reshards)          # the free plan keeps copies
    assert free.estimates.memory_per_device_bytes > budget  # so the budget binds
    tight = planned(memory_budget_per_device=budget)
    assert tight.estimates.memory_per_device_bytes <= budget
