"""``ReshardCosts``' bookkeeping of layouts (``passes/sharding/costgraph.py``): an edge's
distinct layouts found by identity are those found by value."""

from __future__ import annotations

import numpy as np

from torchalpa.core.placement import Partial, Replicate, Shard
from torchalpa.passes.sharding.costgraph import ReshardCosts, _unique


def _layout(rng: np.random.Generator):
    """A fresh object for one of a few 2-D layouts (equal layouts, distinct objects),
    or None (a strategy that does not read the value)."""
    kinds = [lambda: Shard(0), lambda: Shard(1), Replicate, lambda: Partial("sum")]
    pick = rng.integers(0, len(kinds), 2)
    return None if rng.random() < 0.05 else tuple(kinds[int(k)]() for k in pick)


def test_an_edges_distinct_layouts_by_identity_are_those_by_value():
    """``_distinct`` gives what ``_unique`` and ``_id`` gave (the distinct layouts in order
    of first appearance, each item's position, the layouts' ints) on lists where equal
    layouts are distinct objects and objects repeat within and across edges, one
    ``ReshardCosts`` throughout (its ints by identity must stay those by value)."""
    rng = np.random.default_rng(0)
    costs, reference = ReshardCosts.__new__(ReshardCosts), ReshardCosts.__new__(ReshardCosts)
    costs._ids, costs._by_object, reference._ids = {}, {}, {}
    pool = [_layout(rng) for _ in range(40)]
    merged = 0
    for _ in range(400):
        items = [pool[int(i)] if rng.random() < 0.8 else _layout(rng)
                 for i in rng.integers(0, len(pool), int(rng.integers(1, 30)))]
        first, positions, ids = costs._distinct(items)
        expected_first, expected_positions = _unique(items)
        assert [x is y for x, y in zip(first, expected_first)] == [True] * len(expected_first)
        assert len(first) == len(expected_first)
        assert positions.tolist() == expected_positions.tolist()
        assert positions.dtype == expected_positions.dtype
        assert ids == tuple(map(reference._id, expected_first))
        merged += len({id(x) for x in items}) - len(first)
    assert merged > 1000         # equal layouts of distinct objects were told apart by value
