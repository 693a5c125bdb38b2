"""Redistribution of a dim split over two mesh axes: one all-to-all on the inner axis.

Tokens split over both axes of a 2D mesh (Alpa's S01) reach experts split over the inner
axis with the outer axis keeping its block of tokens: each device's tokens are the inner
block of the outer axis's block, so exchanging them over the inner axis rebuilds the outer
block. Gathering and slicing instead costs an all-gather (forbidden under
``allow_all_gather=False``, which left Alpa's MoE layout on (2, 2) infeasible). The
numerics of every such transition are checked in tests/test_reshard.py
(``test_every_transition``)."""

from torchalpa.core.opgraph import TensorSpec
from torchalpa.core.placement import Replicate, Shard
from torchalpa.passes.sharding.reshard import plan_reshard

SPEC = TensorSpec((16, 32, 4, 64))   # (experts, groups, capacity, model)


def _kinds(src, dst):
    return [(s.kind, s.axis) for s in plan_reshard(SPEC, src, dst, (2, 2), False)]


def test_inner_axis_exchanges_directly():
    assert _kinds((Shard(1), Shard(1)), (Shard(1), Shard(0))) == [("all_to_all", 1)]
    assert _kinds((Shard(1), Shard(0)), (Shard(1), Shard(1))) == [("all_to_all", 1)]


def test_outer_axis_still_reassembles():
    """The outer axis's split cannot be exchanged alone: the inner one is reassembled
    first, so the nesting order (axis 0 outer) holds."""
    kinds = _kinds((Shard(1), Shard(1)), (Shard(0), Shard(1)))
    assert ("all_gather", 1) in kinds and ("all_to_all", 0) not in kinds
    # a destination dim split on an inner axis too: no direct exchange on the outer one
    assert ("all_to_all", 0) not in _kinds((Shard(1), Shard(0)), (Shard(0), Shard(0)))
    assert _kinds((Shard(1), Replicate()), (Shard(0), Replicate())) == [("all_to_all", 0)]
