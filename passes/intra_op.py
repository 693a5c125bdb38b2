"""The intra-op pass: OpGraph + logical mesh + options -> Plan.

1. strategies for every node from its rule (replicate-only for ops without one);
2. costs: compute per strategy, resharding per edge (the redistribution planner priced
   by the alpha-beta model), the loss gathered whole on every device, each gradient
   brought to its parameter's layout;
3. the ILP picks one strategy per node;
4. the choice becomes a Plan: placements, every resharding step, the collectives they
   issue, and estimates of step time and memory.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass

import numpy as np

from torchalpa.cluster import LogicalMesh
from torchalpa.methods import ShardParallel
from torchalpa.opgraph import OpGraph, TensorSpec, ValueRef
from torchalpa.passes.cost import compute_cost, steps_cost, wire_bytes
from torchalpa.passes.ilp import ILPProblem, solve_ilp
from torchalpa.passes.memory import activation_peak_bytes, model_state_bytes
from torchalpa.passes.reshard import plan_reshard
from torchalpa.passes.rules import rule_for
from torchalpa.passes.strategies import (Strategy, enumerate_strategies, leaf_strategies,
                                         replicate_only)
from torchalpa.placement import Placements, Replicate, Shard, replicated
from torchalpa.plan import (Collective, NodeStrategy, Plan, Reshard, ReshardStep,
                            ValuePlacement)

__all__ = ["plan_intra_op", "UnsupportedOpWarning", "build_strategies"]

log = logging.getLogger("torchalpa.planner")
OUTPUT = "<output>"


class UnsupportedOpWarning(UserWarning):
    """An op has no sharding rule and runs replicated."""


@dataclass
class StrategySpace:
    strategies: dict[str, list[Strategy]]
    unsupported: list[dict]


def build_strategies(graph: OpGraph, mesh: LogicalMesh, inputs: str = "global") -> StrategySpace:
    """Every node's candidate strategies; ops without a rule get replicate-only."""
    strategies: dict[str, list[Strategy]] = {}
    unsupported: list[dict] = []
    for node in graph:
        if node.is_leaf:
            options = leaf_strategies(node.output, mesh)
            if node.kind == "input" and inputs == "local":
                options = [_batch_sharded(node.output, mesh)]
            strategies[node.name] = options
            continue
        rule = rule_for(node, graph)
        options = enumerate_strategies(rule, mesh) if rule is not None else []
        if not options:
            if rule is None:
                unsupported.append({"op": node.op, "node": node.name, "module": node.module})
            options = replicate_only(node, mesh)
        strategies[node.name] = options
    for item in unsupported:
        warnings.warn(f"no sharding rule for {item['op']} (node {item['node']}"
                      + (f", module '{item['module']}'" if item["module"] else "")
                      + "): it runs replicated on every device", UnsupportedOpWarning,
                      stacklevel=3)
    return StrategySpace(strategies, unsupported)


def _batch_sharded(spec: TensorSpec, mesh: LogicalMesh) -> Strategy:
    """``inputs='local'``: each device already holds its slice of the batch (dim 0)."""
    if spec.shape and spec.shape[0] % mesh.num_devices:
        raise ValueError(f"inputs='local' needs the batch dim ({spec.shape[0]}) divisible by "
                         f"the {mesh.num_devices} devices")
    return Strategy(inputs=(), outputs=(tuple(Shard(0) for _ in mesh.shape),))


class _Costs:
    """Memoized resharding steps and their alpha-beta cost on one mesh."""

    def __init__(self, mesh: LogicalMesh):
        self.mesh = mesh

    def steps(self, spec: TensorSpec, src: Placements, dst: Placements | None):
        if dst is None:
            return ()
        return plan_reshard(spec, src, dst, self.mesh.shape)

    def reshard(self, spec, src, dst) -> float:
        steps = self.steps(spec, src, dst)
        return math.inf if steps is None else steps_cost(self.mesh, steps)


def _edge_matrix(costs: _Costs, spec, producer: list[Strategy], index: int, consumer,
                 pick) -> np.ndarray:
    m = np.empty((len(producer), len(consumer)))
    for a, s in enumerate(producer):
        for b, t in enumerate(consumer):
            m[a, b] = costs.reshard(spec, s.outputs[index], pick(t))
    return m


def plan_intra_op(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel | None = None, *,
                  inputs: str = "global") -> Plan:
    """Solve Alpa's intra-op ILP for ``graph`` on ``mesh`` and return the Plan."""
    method = method or ShardParallel()
    if inputs not in ("global", "local"):
        raise ValueError(f"inputs must be 'global' or 'local', got {inputs!r}")
    start = time.perf_counter()
    space = build_strategies(graph, mesh, inputs)
    S = space.strategies
    costs = _Costs(mesh)
    R = replicated(mesh.ndim)

    node_costs: dict[str, np.ndarray] = {}
    for node in graph:
        c = np.array([compute_cost(mesh, node, s.shards) if not node.is_leaf else 0.0
                      for s in S[node.name]])
        node_costs[node.name] = c
    loss = graph.outputs.loss
    loss_spec = graph.spec(loss)
    node_costs[loss.node] = node_costs[loss.node] + np.array(
        [costs.reshard(loss_spec, s.outputs[loss.index], R) for s in S[loss.node]])

    edges: dict[tuple[str, str], np.ndarray] = {}

    def add_edge(u, v, m):
        edges[(u, v)] = edges[(u, v)] + m if (u, v) in edges else m

    for node in graph.ops():
        for slot, ref in enumerate(node.operands):
            m = _edge_matrix(costs, graph.spec(ref), S[ref.node], ref.index, S[node.name],
                             lambda t, slot=slot: t.inputs[slot])
            add_edge(ref.node, node.name, m)
    params = graph.params
    for fqn, ref in graph.outputs.grads:
        p = params[fqn]
        m = _edge_matrix(costs, graph.spec(ref), S[ref.node], ref.index, S[p],
                         lambda t: t.outputs[0])
        add_edge(ref.node, p, m)

    option = method.auto_sharding_option
    built = time.perf_counter()
    solution = solve_ilp(ILPProblem(node_costs=node_costs, edge_costs=edges),
                         solver=option.solver, time_limit=option.time_limit, gap=option.gap)
    chosen = {k: S[k][i] for k, i in solution.choice.items()}
    plan = _assemble(graph, mesh, method, chosen, costs, space, inputs)
    seconds = time.perf_counter() - start
    num_strategies = sum(len(v) for v in S.values())
    log.info("intra-op plan on mesh %s: %d nodes, %d strategies, ILP %d vars, solved in %.2fs "
             "(build %.2fs), objective %.6g", mesh.shape, len(graph), num_strategies,
             solution.num_variables, solution.seconds, built - start, solution.objective)
    estimates = dict(plan.estimates, objective=solution.objective, solve_seconds=seconds,
                     ilp_seconds=solution.seconds, ilp_variables=solution.num_variables,
                     num_strategies=num_strategies)
    return _replace_estimates(plan, estimates)


def _replace_estimates(plan: Plan, estimates: dict) -> Plan:
    from dataclasses import replace
    return replace(plan, estimates=estimates)


def _assemble(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel,
              chosen: dict[str, Strategy], costs: _Costs, space: StrategySpace,
              inputs: str) -> Plan:
    R = replicated(mesh.ndim)
    reshards: list[Reshard] = []

    def add(ref: ValueRef, consumer: str, slot, dst: Placements | None):
        src = chosen[ref.node].outputs[ref.index]
        steps = costs.steps(graph.spec(ref), src, dst)
        assert steps is not None, (ref, consumer, slot, src, dst)
        if steps:
            reshards.append(Reshard(ref.node, ref.index, consumer, slot, tuple(steps)))

    for node in graph:
        if node.kind == "input" and inputs == "global":
            steps = costs.steps(node.output, R, chosen[node.name].outputs[0])
            if steps:
                reshards.append(Reshard(node.name, 0, node.name, "input", tuple(steps)))
        for slot, ref in enumerate(node.operands):
            add(ref, node.name, slot, chosen[node.name].inputs[slot])
    add(graph.outputs.loss, OUTPUT, "loss", R)
    params = graph.params
    for fqn, ref in graph.outputs.grads:
        add(ref, OUTPUT, f"grad:{fqn}", chosen[params[fqn]].outputs[0])

    collectives = []
    comm_time = wire = 0.0
    for r in reshards:
        if r.consumer == OUTPUT:
            phase = "forward" if r.slot == "loss" else "backward"
            source = graph.node(r.producer).module
        else:
            phase = graph.node(r.consumer).phase
            source = graph.node(r.consumer).module
        for step in r.steps:
            if step.is_collective:
                collectives.append(Collective(kind=step.kind, axis=step.axis, bytes=step.bytes,
                                              phase=phase, source=source, tensor=r.producer,
                                              reduce_op=step.reduce_op))
                # every group along the axis runs this collective
                groups = mesh.num_devices // mesh.shape[step.axis]
                wire += groups * wire_bytes(step.kind, mesh.shape[step.axis], step.bytes,
                                            mesh.backend)
        comm_time += steps_cost(mesh, r.steps)
    compute_time = sum(compute_cost(mesh, n, chosen[n.name].shards) for n in graph.ops())

    leaf_placement = {n.name: chosen[n.name].outputs[0] for n in graph if n.is_leaf}
    state = model_state_bytes(graph, leaf_placement, mesh.shape, method.optimizer_states)
    activations = activation_peak_bytes(graph, {k: s.outputs for k, s in chosen.items()},
                                        mesh.shape)
    estimates = {"step_time_s": comm_time + compute_time, "communication_s": comm_time,
                 "compute_s": compute_time, "model_state_bytes_per_device": state,
                 "activation_bytes_per_device": activations,
                 "memory_per_device_bytes": state + activations,
                 "wire_bytes_per_step": wire}
    parameters = tuple(ValuePlacement(name=n.target, node=n.name, shape=n.output.shape,
                                      placements=leaf_placement[n.name])
                       for n in graph if n.kind in ("param", "buffer"))
    input_values = tuple(ValuePlacement(name=n.target, node=n.name, shape=n.output.shape,
                                        placements=leaf_placement[n.name])
                         for n in graph if n.kind == "input")
    strategies = tuple(NodeStrategy(node=n.name, inputs=chosen[n.name].inputs,
                                    outputs=chosen[n.name].outputs) for n in graph.ops())
    notes = []
    for n in graph:
        if n.kind == "input" and n.output.shape and n.output.shape[0] % mesh.num_devices:
            notes.append(f"{n.target}: batch dim {n.output.shape[0]} does not divide by "
                         f"{mesh.num_devices} devices, so it cannot be fully data-parallel")
    return Plan(
        mesh_shape=mesh.shape, axis_names=mesh.axis_names, parameters=parameters,
        inputs=input_values, strategies=strategies, reshards=tuple(reshards),
        collectives=tuple(collectives), estimates=estimates,
        unsupported_ops=tuple(space.unsupported),
        stages=({"layers": [0], "logical_shape": list(mesh.shape),
                 "num_devices": mesh.num_devices},),
        method=method.to_dict(), graph_fingerprint=graph.fingerprint(), notes=tuple(notes))
