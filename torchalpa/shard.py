"""``plan`` / ``auto_parallel`` for ShardParallel and its presets: one intra-op plan.

Candidate logical meshes (the one asked for, or every 1D/2D view of the cluster), the ILP
on each (cached), the fastest plan kept; under torchrun rank 0 plans, every rank lowers
the plan to its local programs (``runtime.lower``) and wraps the model as a
``ParallelModule``. ``ShardParallel.plan`` / ``.build`` call these (``torchalpa.api``
dispatches through the method object).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from torchalpa.cluster import Cluster, LogicalMesh
from torchalpa.methods import ShardParallel, with_micro_batches
from torchalpa.opgraph import OpGraph
from torchalpa.plan import Plan
from torchalpa.plan_check import check_step_dtypes
from torchalpa.plan_records import Estimates
from torchalpa.workflow import (capture_examples, capture_variants, default_cluster,
                                plan_on_rank0, same_step_on_every_rank, with_precision)

__all__ = ["candidate_meshes", "plan_graph", "blocks_of", "plan_shard", "shard_parallel"]

log = logging.getLogger("torchalpa")

SKIP_BY_BOUND = True
"""Skip a logical mesh whose step-time bound is above a plan already found (``plan_graph``);
False solves every mesh (benchmarks and tests compare)."""


def candidate_meshes(cluster: Cluster | LogicalMesh, method: ShardParallel,
                     shape: tuple[int, ...] | None = None,
                     axis_names: tuple[str, ...] | None = None) -> list[LogicalMesh]:
    """The logical meshes to plan on: the one asked for, or every 1D/2D view of the cluster."""
    shape = tuple(shape or method.logical_mesh_shape or ()) or None
    if isinstance(cluster, LogicalMesh):
        if shape and shape != cluster.shape:
            raise ValueError(f"the LogicalMesh given as cluster has shape {cluster.shape}, but "
                             f"the plan needs {shape}")
        if axis_names and tuple(axis_names) != cluster.axis_names:
            cluster = replace(cluster, axis_names=tuple(axis_names))
        return [cluster]
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a torchalpa.Cluster or LogicalMesh, "
                        f"got {type(cluster).__name__}")
    shapes = [shape] if shape else cluster.candidate_shapes()
    return [cluster.logical_mesh(s, axis_names if shape else None) for s in shapes]


def plan_graph(graph: OpGraph, *, method: ShardParallel, meshes: list[LogicalMesh],
               inputs: str = "global", blocks: dict | None = None) -> Plan:
    """The best plan over ``meshes`` (by estimated step time), reusing cached plans.

    Once a plan is in hand, a mesh whose step-time bound (``step_time_lower_bound``: the
    linear relaxation of its unsimplified ILP) is above that plan's estimate is skipped:
    no plan the ILP could find there would be chosen. The note lists it with its bound.
    The first bound that skips nothing ends the bounding for this call: that LP costs a
    third to a half of a solve on a transformer, whose views plan within a few percent of
    each other, and it would be paid again on every other view."""
    from torchalpa import cache
    from torchalpa.passes.ilp import InfeasibleError
    from torchalpa.passes.intra_op import plan_intra_op, step_time_lower_bound
    from torchalpa.plan_check import check_plan
    from torchalpa.progress import step
    fingerprint = graph.fingerprint()
    plans, failures, skipped = [], [], []
    bounding = SKIP_BY_BOUND
    for i, mesh in enumerate(meshes):
        key = cache.plan_key(fingerprint, mesh, method, inputs)
        shape = "x".join(map(str, mesh.shape))
        with step(f"mesh {i + 1}/{len(meshes)} ({shape}) solving") as progress:
            found = cache.load_cached(key, lambda p, source, shape=tuple(mesh.shape): check_plan(
                p, fingerprint=fingerprint, source=source, mesh_shape=shape, graph=graph))
            if isinstance(found, Plan):
                progress.done = "cached, " + _estimate_text(found, mesh)
                plans.append(found)
                continue
            fastest = min(plans, key=lambda p: p.estimates["step_time_s"], default=None)
            if fastest is not None and bounding:
                bound = step_time_lower_bound(graph, mesh, method, inputs=inputs)
                if bound is not None and bound > fastest.estimates["step_time_s"] * (1 + 1e-9):
                    skipped.append((mesh, bound))
                    progress.done = (f"skipped: no plan here beats {bound * 1e3:.3g} ms/step "
                                     "(a bound), slower than one found")
                    continue
                # a bound that skips nothing cost an LP for nothing: where views plan
                # alike (transformers) the other meshes are solved without one
                bounding = False
            try:
                found = plan_intra_op(graph, mesh, method, inputs=inputs, blocks=blocks)
            except InfeasibleError as e:
                failures.append(e)
                progress.done = f"does not fit: {e}"
                continue
            budget = method.auto_sharding_option.memory_budget_per_device or \
                mesh.memory_per_device
            if budget:      # recorded for reports and pictures
                found = replace(found, estimates=Estimates.from_dict(
                    dict(found.estimates, memory_budget_per_device_bytes=budget)))
            progress.done = _estimate_text(found, mesh)
        cache.store(key, found)
        cache.trim()
        plans.append(found)
    if not plans:
        raise failures[0] if len(failures) == 1 else InfeasibleError(
            "no logical mesh fits the memory budget:\n" + "\n".join(f"  {e}" for e in failures))
    best = min(plans, key=lambda p: p.estimates["step_time_s"])
    log.info("chose mesh %s: %s", "x".join(map(str, best.mesh_shape)),
             _estimate_text(best, meshes[0]))
    if len(meshes) > 1:
        tried = ", ".join(f"{'x'.join(map(str, p.mesh_shape))}: "
                          f"{p.estimates['step_time_s'] * 1e3:.3g} ms" for p in plans)
        tried += "".join(f", {'x'.join(map(str, m.shape))}: >= {bound * 1e3:.3g} ms "
                         "(bound, not solved)" for m, bound in skipped)
        best = replace(best, notes=best.notes + (f"logical meshes tried (estimated step): {tried}",))
    return best


def _estimate_text(plan: Plan, mesh: LogicalMesh) -> str:
    """``est 630 ms/step, 45.5 GiB of 74.5``: a plan's estimates against the budget."""
    est = plan.estimates
    text = f"est {est.get('step_time_s', 0) * 1e3:.3g} ms/step"
    memory = est.get("memory_per_device_bytes")
    if memory is not None:
        from torchalpa.report import format_bytes
        text += f", {format_bytes(memory)}"
        budget = est.get("memory_budget_per_device_bytes") or mesh.memory_per_device
        if budget:
            text += f" of {format_bytes(budget)}"
    return text


def blocks_of(graph: OpGraph) -> dict | None:
    """Repeated layers the frontend tagged, if it found any."""
    return graph.meta.get("repeated_blocks") or None


def plan_shard(model, example_inputs, loss_fn, *, method: ShardParallel,
               cluster: Cluster | LogicalMesh | None, inputs: str, param_argnums=0,
               num_params: int | None = None) -> Plan:
    """``torchalpa.plan`` for ``method``: a torch model's step (each activation-
    checkpointing variant ``remat`` asks for), or a JAX function / StableHLO program."""
    from torchalpa.programs import is_program, program_graph
    if is_program(model):
        if loss_fn is not None:
            raise ValueError("a JAX function or StableHLO program carries its own loss: "
                             "pass no loss_fn")
        graph = program_graph(model, example_inputs, param_argnums=param_argnums,
                              num_params=num_params)
        return plan_graph(graph, method=method, inputs=inputs,
                          meshes=candidate_meshes(cluster or default_cluster(1), method))
    from torchalpa.passes.remat_choice import plan_with_remat
    from torchalpa.runtime.mesh import world_size
    meshes = candidate_meshes(cluster or default_cluster(world_size()), method)
    if method.num_micro_batches > 1:      # the plan is made for one micro-batch
        example_inputs = capture_examples(model, example_inputs, method.num_micro_batches)
    variants = capture_variants(model, example_inputs, loss_fn, method.auto_sharding_option)
    check_step_dtypes(next(iter(variants.values())).graph)
    return plan_with_remat(variants, lambda c: plan_graph(
        c.graph, method=method, meshes=meshes, inputs=inputs, blocks=blocks_of(c.graph)),
        lambda c: c.graph)


def shard_parallel(model, example_inputs, loss_fn, *, method: ShardParallel, signature, mesh,
                   cluster, inputs, optimizer, plan, num_micro_batches, mixed_precision,
                   init_weights, compile, check_replicas, check_inputs):
    """``torchalpa.auto_parallel`` for ``method`` (its options checked there): rank 0
    plans, every rank lowers its local programs and distributes the parameters."""
    from torchalpa.runtime import mesh as mesh_mod
    from torchalpa.runtime.lower import lower
    from torchalpa.runtime.materialize import distribute_module_state
    from torchalpa.runtime.module import ParallelModule
    from torchalpa.runtime.random import sync_random_state
    from torchalpa.runtime.step import StepRunner

    method = with_micro_batches(method, num_micro_batches)     # priced as it runs
    num_micro_batches = method.num_micro_batches
    mesh_mod.init_distributed()
    world = mesh_mod.world_size()
    shape = names = None
    if mesh is not None:
        if mesh.size() != world:
            raise ValueError(f"the mesh has {mesh.size()} devices but this job has {world} "
                             "ranks; torchalpa needs a mesh over all ranks")
        shape = tuple(mesh.shape)
        names = tuple(mesh.mesh_dim_names or (f"axis{i}" for i in range(len(shape))))
        if method.logical_mesh_shape and tuple(method.logical_mesh_shape) != shape:
            raise ValueError(f"method.logical_mesh_shape {method.logical_mesh_shape} differs from "
                             f"the mesh's shape {shape}")
    elif method.logical_mesh_shape:
        shape = tuple(method.logical_mesh_shape)
        mesh_mod.check_world_size(shape)
    cluster = cluster or default_cluster(world, measure=True)
    meshes = candidate_meshes(cluster, method, shape, names)

    start = time.perf_counter()
    traced = with_precision(model, mixed_precision)
    from torchalpa.passes.remat_choice import chosen_remat, plan_with_remat
    variants = capture_variants(traced, capture_examples(model, example_inputs,
                                                           num_micro_batches),
                                 loss_fn, method.auto_sharding_option, signature=signature)
    captured = next(iter(variants.values()))
    check_step_dtypes(captured.graph)
    fingerprint = captured.graph.fingerprint()
    same_step_on_every_rank(fingerprint)
    if plan is not None:
        if chosen_remat(plan) not in variants:      # a plan made with another remat setting
            variants = capture_variants(traced, capture_examples(
                model, example_inputs, num_micro_batches), loss_fn, replace(
                method.auto_sharding_option, remat=chosen_remat(plan)), signature=signature)
        captured = variants[chosen_remat(plan)]
        _check_given_plan(plan, captured.graph.fingerprint(), shape, captured.graph)
        the_plan = plan
    else:
        the_plan = plan_on_rank0(lambda: plan_with_remat(variants, lambda c: plan_graph(
            c.graph, method=method, meshes=meshes, inputs=inputs, blocks=blocks_of(c.graph)),
            lambda c: c.graph))
        captured = variants[chosen_remat(the_plan)]
    device_mesh = mesh if mesh is not None else mesh_mod.build_mesh(the_plan.mesh_shape,
                                                                    the_plan.axis_names)
    device = mesh_mod.default_device()
    coords = device_mesh.get_coordinate()
    groups = [device_mesh.get_group(i).group_name for i in range(device_mesh.ndim)]

    def lower_program(gm, a_plan, param_names, buffer_updates=(), buffer_names=(), micro=1):
        return lower(gm, a_plan, param_names, coords=coords, group_names=groups, device=device,
                     buffer_updates=buffer_updates, buffer_names=buffer_names,
                     num_micro_batches=micro)

    program = lower_program(captured.gm, the_plan, captured.param_names,
                            captured.buffer_updates, captured.buffer_names, num_micro_batches)
    if compile:
        program = program.compiled(**(compile if isinstance(compile, dict) else {}))
    distribute_module_state(model, the_plan, device_mesh, device, init_weights=init_weights)
    input_specs = [(tuple(x.shape), x.dtype) for x in example_inputs]
    if inputs == "local":
        input_specs = [(tuple(s // device_mesh.size() if i == 0 else s
                              for i, s in enumerate(shp)), dt) for shp, dt in input_specs]
    forward_programs = _forward_programs(
        traced, loss_fn, the_plan, method, candidate_meshes(
            cluster, method, tuple(the_plan.mesh_shape), tuple(the_plan.axis_names))[0],
        inputs, lambda gm, p, updates: lower_program(gm, p, [], updates).forward, signature)
    sync_random_state(device)    # last: planning or initialization may have drawn on rank 0
    log.info("auto_parallel ready in %.2fs: %s", time.perf_counter() - start,
             captured.graph.summary())
    return ParallelModule(model, the_plan, StepRunner(program, num_micro_batches), device_mesh,
                          input_specs=input_specs, inputs=inputs, device=device,
                          optimizer=optimizer, forward_programs=forward_programs,
                          signature=signature,
                          check_replicas=check_replicas, check_inputs=check_inputs)


def _check_given_plan(plan: Plan, fingerprint: str, mesh_shape, graph=None) -> None:
    """A ``plan=`` is checked like a cached one: step, mesh, shapes and layouts."""
    from torchalpa.plan_check import check_plan
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a torchalpa.Plan, got {type(plan).__name__}")
    check_plan(plan, fingerprint=fingerprint, source="the plan passed as plan=",
               mesh_shape=mesh_shape, graph=graph)


# -- auto_parallel's runtime options ----------------------------------------------------

def _forward_programs(traced, loss_fn, training_plan: Plan, method: ShardParallel,
                      logical_mesh: LogicalMesh, inputs: str, lower_forward, signature=None):
    """Forward-only programs (predict, eval mode) planned with the training layouts pinned."""
    from torchalpa.runtime.inference import ForwardPrograms, pins_of
    option = replace(method.auto_sharding_option,
                     pin=tuple(method.auto_sharding_option.pin) + pins_of(training_plan))
    pinned = replace(method, auto_sharding_option=option)

    def plan_forward(graph: OpGraph) -> Plan:
        same_step_on_every_rank(graph.fingerprint())
        return plan_on_rank0(lambda: plan_graph(graph, method=pinned, meshes=[logical_mesh],
                                                 inputs=inputs, blocks=blocks_of(graph)))

    return ForwardPrograms(traced, loss_fn, training_plan, plan_forward, lower_forward,
                           signature=signature)
