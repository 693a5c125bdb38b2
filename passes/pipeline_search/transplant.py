"""A stage's intra-op plan moved onto identical layers elsewhere in the model.

The pipeline search solves a range of layers once per structure (``layer_cache``): GPT's
layers 4-5 and 8-9 are the same problem. But the pipeline is assembled from plans that
name the stage's own nodes and parameters, so a stage whose structure was solved at
another depth used to be solved again when the pipeline was put together. Here the solved
plan's choice of strategy is carried over node by node (the i-th node of one stage graph
to the i-th of the other, checked to be the same op with the same operand wiring) and the
plan is rebuilt for the new graph, as the ILP's own plan is built from its choice. The
price is checked against the donor's: identical structure, identical step time, or no
plan (the caller solves).
"""

from __future__ import annotations

import math
from dataclasses import replace

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.plan import Plan
from torchalpa.core.plan_records import known
from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
from torchalpa.passes.sharding.strategies import Strategy

__all__ = ["transplant"]


def _node_map(donor: OpGraph, graph: OpGraph) -> dict[str, str] | None:
    """Donor node name -> ``graph``'s, position by position, if the two graphs are the
    same ops wired the same way (else None)."""
    donor_nodes, nodes = list(donor), list(graph)
    if len(donor_nodes) != len(nodes):
        return None
    names: dict[str, str] = {}
    for d, n in zip(donor_nodes, nodes):
        if (d.op, d.kind, d.outputs, d.args, d.kwargs, len(d.operands)) != \
                (n.op, n.kind, n.outputs, n.args, n.kwargs, len(n.operands)):
            return None
        names[d.name] = n.name
    for d, n in zip(donor_nodes, nodes):
        for a, b in zip(d.operands, n.operands):
            if names.get(a.node) != b.node or a.index != b.index:
                return None
    return names


def transplant(plan: Plan, donor: OpGraph, graph: OpGraph, mesh: LogicalMesh, method,
               inputs: str = "global", memo: PricingMemo | None = None,
               step_micro_batches: int = 1) -> Plan | None:
    """``plan`` (made by ``plan_intra_op`` for ``donor`` on ``mesh``) for ``graph``, a
    graph of the same structure with other names; None if the structures differ, a
    chosen strategy is not offered in ``graph`` or the rebuilt plan's step time is not
    the donor's. ``memo``, ``step_micro_batches``: as in ``plan_intra_op``."""
    from torchalpa.passes.pipeline_search.view_classes import strategy_key
    from torchalpa.passes.sharding.intra_op import intra_op_problem, planned_for
    from torchalpa.passes.sharding.sharding_plan import assemble_plan, merge_gradient_all_reduces
    names = _node_map(donor, graph)
    if names is None:
        return None
    wanted = {names[s.node]: _strategy_key_of(s) for s in plan.strategies if s.node in names}
    for v in plan.parameters + plan.inputs:
        if v.node in names:
            wanted[names[v.node]] = ((), (v.placements,), ())
    option, mesh, graph, space, costs = intra_op_problem(graph, mesh, method, inputs, memo)
    chosen: dict[str, Strategy] = {}
    for node in graph:
        key = wanted.get(node.name)
        found = None if key is None else next(
            (s for s in space.strategies[node.name] if strategy_key(s) == key
             or (node.is_leaf and s.outputs == key[1])), None)
        if found is None:
            return None
        chosen[node.name] = found
    moved = merge_gradient_all_reduces(
        assemble_plan(graph, mesh, method, chosen, costs, space, inputs, step_micro_batches),
        graph, mesh, option)
    was, now = known(plan.estimates.step_time_s), known(moved.estimates.step_time_s)
    if not math.isclose(was, now, rel_tol=1e-9, abs_tol=1e-15):
        return None
    e = plan.estimates
    kept = {k: v for k, v in (
        ("objective", e.objective), ("solve_seconds", e.solve_seconds),
        ("ilp_seconds", e.ilp_seconds), ("ilp_variables", e.ilp_variables),
        ("num_strategies", e.num_strategies), ("num_decisions", e.num_decisions),
        ("flops_per_step", e.flops_per_step), ("peak_flops_per_device", e.peak_flops_per_device),
        ("memory_budget_bytes", e.memory_budget_bytes)) if v is not None}
    target = planned_for(mesh, option.memory_budget_per_device or mesh.memory_per_device)
    return replace(moved, estimates=replace(moved.estimates, **kept),
                   notes=moved.notes + ((target,) if target else ()))


def _strategy_key_of(s) -> tuple:
    """A plan's NodeStrategy as ``view_classes.strategy_key`` writes a Strategy's."""
    return (s.inputs, s.outputs, tuple(axis for axis, _ in s.batch_syncs))
