"""Logical views that can shard the same dims, and pricing one view's plan on another.

The pipeline search plans every distinct layer on every logical view of every submesh
(``passes/pipeline_search/layer_costs.py``). On a cluster of many nodes most of those views differ only in
their sizes: on 50 x 4 devices, (6, 2), (12, 2), ..., (48, 2) all have an inter-node
axis that divides the intermediate dim 13824 and nothing else, and an intra-node axis
of 2 that divides the same dims. Such views have the same strategies (a
strategy names placements, ``Shard(dim)``, not sizes, and a split is legal when the
axis divides the dim), so a plan solved on one of them is a legal plan on every other:
only its price changes with the sizes.

``view_class`` is that equivalence: per axis, its link (latency, inverse bandwidth) and
the dims it divides, and for a 2D view the dims both axes together divide (Alpa's S01);
and one size is kept whole: the last axis's, the devices of a node a tensor-parallel op
spans. Views that differ there are legal for each other's plans but rarely share an
optimum (GPT-39B on 8 x 8: (8, 2), (4, 4) and (2, 8) of a 2-node submesh were one class,
and the search that priced one's plan on the others chose 8 stages estimated 1.6 %
slower than the 5 it chooses with them apart, ``benchmarks/search_39b.py``); views that
differ only in how many nodes (or node groups) the first axis spans do share one (the
same 39B search then solves 51 layers instead of 114, same plan).

``reprice`` takes a solved plan to another view of its class and prices its very
strategies there with the cost model (collectives, compute, model states, activations),
no ILP: a plan that is feasible there, so its time is an upper bound of that view's
optimum (the chosen stages are priced again by their own ILP in any case). It offers
each node the strategies ``build_strategies`` does, strided shards included (a fused
q/k/v weight split by heads, ``passes/sharding/strides.py``): without them no GPT plan that split
attention by heads carried over, and every view was solved.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.placement import is_shard
from torchalpa.core.plan import Plan
from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
from torchalpa.passes.sharding.strategies import Strategy

__all__ = ["ViewClass", "view_class", "reprice", "strategy_key"]


@dataclass(frozen=True)
class ViewClass:
    """What decides which strategies a logical view offers, and how each axis's links
    are priced: per axis (latency, inverse bandwidth, dims it divides); for two axes
    also the dims their product divides; and the last axis's size (see module doc)."""

    axes: tuple[tuple[float, float, frozenset[int]], ...]
    both: frozenset[int]
    inner: int


def view_class(mesh: LogicalMesh, dims: frozenset[int]) -> ViewClass:
    """The class of ``mesh`` given every dim size of the graph's values."""
    assert mesh.alpha is not None and mesh.beta is not None   # LogicalMesh fills them
    axes = tuple((mesh.alpha[a], mesh.beta[a], frozenset(d for d in dims if d % size == 0))
                 for a, size in enumerate(mesh.shape))
    both = frozenset(d for d in dims if len(mesh.shape) == 2
                     and d % (mesh.shape[0] * mesh.shape[1]) == 0)
    return ViewClass(axes, both, mesh.shape[-1])


def strategy_key(s: Strategy) -> tuple:
    """A strategy's identity across views of one class (placements, not sizes)."""
    return (s.inputs, s.outputs, tuple(axis for axis, _ in s.batch_syncs))


def _overlap(layout, wanted) -> int:
    """Mesh axes on which ``layout`` places a value as ``wanted`` does."""
    return sum(1 for a, b in zip(layout, wanted) if a == b)


def reprice(graph: OpGraph, plan: Plan, mesh: LogicalMesh, method, inputs: str = "global",
            *, relayout_parameters: bool = False, rules: dict | None = None,
            memo: PricingMemo | None = None, step_micro_batches: int = 1) -> Plan | None:
    """``plan`` (solved for ``graph`` on a view of ``mesh``'s class) with the same
    strategies, priced on ``mesh``; None if a strategy it chose is not legal on ``mesh``
    (the views were not of one class).

    ``relayout_parameters``: every parameter takes the fully sharded layout closest to
    the one ``plan`` gave it (where one exists), and the plan gathers it where it is read:
    the fastest plan made lean (ZeRO-3 over the axes that replicated it), priced, in
    place of an ILP solve with ``parameters='sharded'``.

    Only the chosen strategies are looked up (the class guarantees the rest of the space
    is the same), so pricing costs a fraction of the ILP's build; the plan's per-parameter
    explanations list no alternatives. ``rules``: a memo of each node's sharding rule
    (they do not depend on the mesh), filled here, for pricing one graph many times;
    ``memo``: pricing work kept across solves (``passes/pipeline_search/pricing_memo.py``);
    ``step_micro_batches``: as ``plan_intra_op`` takes it."""
    from torchalpa.passes.sharding.intra_op import effective_option, forbidden_collectives
    from torchalpa.passes.sharding.sharding_plan import assemble_plan, merge_gradient_all_reduces
    from torchalpa.passes.sharding.strategies import StrategySpace
    memo = PricingMemo() if memo is None else memo
    option, mesh = effective_option(method.auto_sharding_option, mesh)
    if mesh.gradient_bucket_bytes > 0 and option.all_reduce_threshold is not None:
        # as plan_intra_op prices it: the runtime packs gradients into such buckets
        mesh = replace(mesh, gradient_bucket_bytes=float(option.all_reduce_threshold))
    wanted = {s.node: (s.inputs, s.outputs, tuple(a for a, _ in s.batch_syncs))
              for s in plan.strategies}
    for v in plan.parameters + plan.inputs:
        wanted[v.node] = ((), (v.placements,), ())
    chosen: dict[str, Strategy] = {}
    random = set()
    for node in graph:
        key = wanted.get(node.name)
        if key is None:
            return None
        options, is_random = _offered(node, graph, mesh, option,
                                      {} if rules is None else rules, memo)
        if is_random:
            random.add(node.name)
        if node.kind == "param" and relayout_parameters:
            was = key[1][0]
            sharded = [s for s in options if _fully_sharded(s.outputs[0], mesh.shape)]
            found = max(sharded, key=lambda s: _overlap(s.outputs[0], was)) \
                if sharded else None
        else:
            found = None
        if found is None:
            found = next((s for s in options if strategy_key(s) == key
                          or (node.is_leaf and s.outputs == key[1])), None)
        if found is None:
            return None
        chosen[node.name] = found
    costs = memo.reshard_costs(mesh, option.allow_reduce_scatter,
                               forbidden_collectives(option))
    space = StrategySpace({name: [s] for name, s in chosen.items()}, [], [],
                          random=frozenset(random))
    try:
        priced = assemble_plan(graph, mesh, method, chosen, costs, space, inputs,
                               step_micro_batches)
    except AssertionError:     # a reshard the other view allowed is impossible here
        return None
    return merge_gradient_all_reduces(priced, graph, mesh, option)


def _offered(node, graph: OpGraph, mesh: LogicalMesh, option, rules: dict,
             memo: PricingMemo) -> tuple[list[Strategy], bool]:
    """The strategies ``build_strategies`` starts from for ``node`` (before constraints
    and pruning, which keep or drop the same ones on every view of a class), and whether
    its rule draws random numbers."""
    from torchalpa.passes.rules import rule_for
    from torchalpa.passes.sharding.strategies import leaf_strategies, replicate_only
    from torchalpa.passes.sharding.strides import strided_regions
    if _STRIDES not in rules:
        rules[_STRIDES] = strided_regions(graph)
    strides = rules[_STRIDES].get(node.name, ())
    if node.is_leaf:
        return leaf_strategies(node.output, mesh, strides), False
    if node.name not in rules:
        rules[node.name] = rule_for(node, graph)
    rule = rules[node.name]
    if rule is None:
        return replicate_only(node, mesh), False
    if rule.random and option.random == "replicated":
        rule = replace(rule, blocked=frozenset(rule.factors()))
    options = list(memo.rule_strategies(rule, mesh, option.allow_recompute_heavy_op, strides))
    return options or replicate_only(node, mesh), bool(rule.random)


_STRIDES = ("strided regions",)
"""Where ``_offered``'s memo keeps the graph's ``strided_regions`` (no node is named so)."""


def _fully_sharded(layout, shape) -> bool:
    return all(is_shard(p) or n == 1 for p, n in zip(layout, shape))
