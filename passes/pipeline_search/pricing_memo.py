"""Memos of pure pricing work, kept by whoever plans many graphs on the same views.

The pipeline search plans every distinct layer on every view, then stages on the views
the DP picks; a ShardParallel plan solves and bounds several meshes. Four pieces of each
intra-op solve's build depend only on things that repeat across those solves:

- a resharding's price: the tensor, the two layouts and the mesh's links
  (``ReshardCosts``, one per view and options). Pricing them again per solve was a fifth
  of the GPT-1.3B pipeline search (536k lookups, profiled);
- a rule's strategies: the rule, the mesh's shape and the flags (``enumerate_strategies``;
  strategies are frozen, so the lists' items may be shared). Enumerating them again was an
  eighth of GPT-1.3B's search (profiled);
- whether a layout can be resharded into another: the tensor, the layouts and the mesh's
  shape;
- a leaf's strategies (a parameter's, an input's layouts): the tensor's and the mesh's
  shapes and the strided splits allowed, made again per view before (a tenth of
  ``build_strategies`` on target a's bounds).

``PricingMemo`` holds them for the planner that owns it and passes it to each solve
(``plan_intra_op(memo=...)``); a solve given none makes its own. Each entry is a function
of its key alone, so a memo changes how long planning takes, never a plan. Bounded: the
reshard prices keep the most recently used ``max_meshes`` views, the others are emptied
when they reach ``max_entries``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import TensorSpec
from torchalpa.passes.rules.registry import FactorRule
from torchalpa.passes.sharding.costgraph import ReshardCosts
from torchalpa.passes.sharding.strategies import Strategy, enumerate_strategies, leaf_strategies

__all__ = ["PricingMemo"]


class PricingMemo:
    """Reshard prices per view, strategies per rule and mesh shape, and reachable
    layouts per mesh shape (module doc)."""

    def __init__(self, max_meshes: int = 64, max_entries: int = 200_000):
        self.max_meshes, self.max_entries = max_meshes, max_entries
        self._reshard_costs: OrderedDict[tuple, ReshardCosts] = OrderedDict()
        self._strategies: dict[tuple, list[Strategy]] = {}
        self._reachable: dict[tuple, dict] = {}
        self._by_rule_object: dict[tuple, tuple] = {}   # (id(rule), ...) -> (rule, strategies)
        self._leaves: dict[tuple, list[Strategy]] = {}

    def reshard_costs(self, mesh: LogicalMesh, allow_reduce_scatter: bool = True,
                      forbidden: frozenset = frozenset()) -> ReshardCosts:
        """The ``ReshardCosts`` of ``mesh`` with these options, made once. The memory
        budget does not change a price and is left out of the key."""
        key = (replace(mesh, memory_per_device=None), allow_reduce_scatter, frozenset(forbidden))
        costs = self._reshard_costs.get(key)
        if costs is None:
            costs = self._reshard_costs[key] = ReshardCosts(*key)
            while len(self._reshard_costs) > self.max_meshes:
                self._reshard_costs.popitem(last=False)
        self._reshard_costs.move_to_end(key)
        return costs

    def rule_strategies(self, rule: FactorRule, mesh: LogicalMesh, recompute_heavy: bool,
                        strides: tuple[tuple[int, int], ...] = ()) -> list[Strategy]:
        """``enumerate_strategies`` of ``rule`` on ``mesh``'s shape, made once."""
        # a graph's node keeps its rule object from view to view: found by identity, its
        # fields (tuples of tuples, hashed in Python) are hashed once per rule object
        by_id = (id(rule), mesh.shape, recompute_heavy, strides)
        known = self._by_rule_object.get(by_id)
        if known is not None and known[0] is rule:
            return known[1]
        key = (rule, mesh.shape, recompute_heavy, strides)
        found = self._strategies.get(key)
        if found is None:
            if len(self._strategies) >= self.max_entries:
                self._strategies.clear()
                self._by_rule_object.clear()
            found = self._strategies[key] = enumerate_strategies(rule, mesh, recompute_heavy,
                                                                 strides)
        if len(self._by_rule_object) >= self.max_entries:
            self._by_rule_object.clear()
        self._by_rule_object[by_id] = (rule, found)     # the rule held: its id stays its own
        return found

    def leaf_strategies(self, spec: TensorSpec, mesh: LogicalMesh,
                        strides: tuple[tuple[int, int], ...] = ()) -> list[Strategy]:
        """``strategies.leaf_strategies`` made once per shape (of the tensor and of the
        mesh) and ``strides``: a leaf's layouts read nothing else of it. A list the
        caller may not change (copy it to)."""
        key = (spec.shape, mesh.shape, strides)
        found = self._leaves.get(key)
        if found is None:
            if len(self._leaves) >= self.max_entries:
                self._leaves.clear()
            found = self._leaves[key] = leaf_strategies(spec, mesh, strides)
        return found

    def reachable(self, mesh_shape: tuple[int, ...]) -> dict:
        """Per mesh shape: (tensor spec, source layouts) -> {wanted layout: whether some
        source reshards into it}, filled by the caller."""
        if len(self._reachable) >= 64 or \
                sum(len(v) for v in self._reachable.values()) >= self.max_entries:
            self._reachable.clear()
        return self._reachable.setdefault(mesh_shape, {})
