"""``plan`` / ``auto_parallel`` for ShardParallel and its presets: one intra-op plan.

Candidate logical meshes (the one asked for, or every 1D/2D view of the cluster), the ILP
on each (cached), the fastest plan kept; under torchrun rank 0 plans, every rank lowers
the plan to its local programs (``runtime.lowering.lower``) and wraps the model as a
``ParallelModule``. ``ShardParallel.plan`` / ``.build`` call these (``torchalpa.parallel.api``
dispatches through the method object).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torchalpa.core.cluster import Cluster, LogicalMesh
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import ShardParallel, with_micro_batches
from torchalpa.core.plan import Plan
from torchalpa.core.plan_check import check_plan
from torchalpa.core.plan_records import known
from torchalpa.core.progress import step
from torchalpa.core.switches import SearchSwitches
from torchalpa.core.units import format_bytes
from torchalpa.parallel import cache
from torchalpa.parallel.steps import Placed, PlacedForward
from torchalpa.parallel.workflow import (
    default_cluster,
    plan_on_rank0,
    planning_gc,
    same_step_on_every_rank,
)

__all__ = ["candidate_meshes", "plan_graph", "blocks_of", "IntraOpSteps", "IntraOpTarget"]

log = logging.getLogger("torchalpa")

def candidate_meshes(cluster: Cluster | LogicalMesh, method: ShardParallel,
                     shape: tuple[int, ...] | None = None,
                     axis_names: tuple[str, ...] | None = None) -> list[LogicalMesh]:
    """The logical meshes to plan on: the one asked for, or every 1D/2D view of the cluster.
    A plan made with ``force_data_parallel`` on a LogicalMesh of several axes was made on
    that mesh flattened to one (``effective_option``): its shape names the flattened mesh."""
    shape = tuple(shape or method.logical_mesh_shape or ()) or None
    if isinstance(cluster, LogicalMesh):
        mesh: LogicalMesh = cluster
        option = method.auto_sharding_option
        if shape and shape != mesh.shape and option.force_data_parallel and \
                shape == (mesh.num_devices,):
            from torchalpa.passes.sharding.intra_op import effective_option
            mesh = effective_option(option, mesh)[1]
        if shape and shape != mesh.shape:
            raise ValueError(f"the LogicalMesh given as cluster has shape {mesh.shape}, but "
                             f"the plan needs {shape}")
        if axis_names and tuple(axis_names) != mesh.axis_names:
            mesh = replace(mesh, axis_names=tuple(axis_names))
        return [mesh]
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a torchalpa.Cluster or LogicalMesh, "
                        f"got {type(cluster).__name__}")
    shapes = [shape] if shape else cluster.candidate_shapes()
    return [cluster.logical_mesh(s, axis_names if shape else None) for s in shapes]


@planning_gc()
def plan_graph(graph: OpGraph, *, method: ShardParallel, meshes: list[LogicalMesh],
               inputs: str = "global", blocks: dict | None = None,
               deadline: float | None = None, bound_views: bool | None = None,
               memo=None, workers: int = 1, skip: dict[int, str] | None = None,
               outcomes: dict | None = None, sharing: dict | None = None,
               starts: dict[int, Plan] | None = None) -> Plan:
    """The best plan over ``meshes`` (by estimated step time), reusing cached plans.

    A mesh whose memory lower bound exceeds the budget is refused with no ILP built, and so
    is one about to be solved whose memory floor does (``view_floor.floor_refusal``: every
    plan holds more at some point; listed in the plan's notes). With a plan in hand, a mesh
    whose LP step-time bound is above its estimate is skipped, noted, until a bound skips
    nothing (``bound_views``; None: ``SearchSwitches.skip_by_bound``).
    Past ``deadline`` (a safety net) no further mesh is solved once a plan is in hand;
    before it each solve gets the time left (a plan cut short is not cached). ``workers`` >
    1, not bounding: the ILPs solved at once in processes (``_solve_apart``). ``skip``: mesh
    index -> why not solved (a caller's reuse); ``outcomes``: mesh index -> its plan or its
    InfeasibleError; ``sharing``: ``plan_intra_op``'s, kept across graphs; ``starts``: mesh
    index -> a plan of ``graph`` there found before, the solver's start (``plan_intra_op``'s
    ``start_from``)."""
    from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
    from torchalpa.passes.pricing.bounds import step_profile
    from torchalpa.passes.sharding.ilp import InfeasibleError
    fingerprint, memo = graph.fingerprint(), PricingMemo() if memo is None else memo
    plans, failures, skipped, refused, late, unfit = [], [], [], [], [], []
    skip, outcomes, starts = skip or {}, {} if outcomes is None else outcomes, starts or {}
    bounding = SearchSwitches.current().skip_by_bound if bound_views is None else bound_views
    profile = step_profile(graph, meshes[0], optimizer_states=method.optimizer_states,
                           eager=method.auto_sharding_option.elementwise != "fused",
                           optimizer=method.optimizer)
    apart = {} if bounding or workers <= 1 else _solve_apart(
        graph, method, meshes, inputs, blocks, memo, deadline, workers, profile, fingerprint,
        skip, sharing, starts)
    for i, mesh in enumerate(meshes):
        key = cache.plan_key(fingerprint, mesh, method, inputs)
        with step(f"mesh {i + 1}/{len(meshes)} ({_shape(mesh)}) solving") as progress:
            found = _cached(key, graph, fingerprint, mesh)
            if isinstance(found, Plan):
                progress.done = "cached, " + _estimate_text(found, mesh)
                plans.append(found)
                continue
            if (too_small := memory_refusal(profile, mesh, method)) is not None:
                failures.append(too_small)
                refused.append(mesh)
                progress.done = f"does not fit: {too_small}"
                continue
            fastest = min(plans, key=lambda p: p.estimates.step_time_s, default=None)
            if i not in apart and i not in skip and fastest is not None and \
                    deadline is not None and time.perf_counter() > deadline:
                late.append(mesh)
                progress.done = "not solved: the time budget is spent"
                continue
            why = skip.get(i) or (fastest is not None and bounding and _bound_above(
                graph, mesh, method, inputs, memo, fastest, blocks)) or None
            if why is not None:
                skipped.append((mesh, why))
                progress.done = f"skipped: {why}"
                continue
            bounding = bounding and fastest is None   # an LP for nothing: views plan alike
            found = outcomes[i] = apart[i] if i in apart else _solved(
                graph, mesh, method, inputs, blocks, memo, sharing,
                deadline if fastest is not None else None, starts.get(i))
            if isinstance(found, InfeasibleError):    # raised here or in a worker
                failures.append(found)
                unfit.append((mesh, found))
                progress.done = f"does not fit: {found}"
                continue
            found = _with_budget(found, method, mesh)
            progress.done = _estimate_text(found, mesh)
        if not clock_stopped(found):   # a plan the clock cut short is not what the key promises
            cache.store(key, found)
            cache.trim()
        plans.append(found)
    if not plans:
        raise _no_mesh_fits(failures, refused, meshes, profile, method,
                            lambda: fitting_advice(profile, meshes, method, graph, inputs))
    return _chosen(plans, skipped + [(m, _unfit_text(e)) for m, e in unfit], late, meshes)


def _solved(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel, inputs: str,
            blocks: dict | None, memo, sharing: dict | None, deadline: float | None,
            start: Plan | None = None):
    """``plan_intra_op``'s plan of ``mesh``, or the InfeasibleError it raised; a
    ``FloorRefusal`` without an ILP where the view's memory floor is above its budget
    (``view_floor.floor_refusal``: every ILP of it would end without a plan)."""
    from torchalpa.passes.sharding.ilp import InfeasibleError
    from torchalpa.passes.sharding.intra_op import plan_intra_op
    from torchalpa.passes.sharding.view_floor import floor_refusal
    refused = floor_refusal(graph, mesh, method, inputs=inputs, memo=memo)
    if refused is not None:
        return refused
    try:
        return plan_intra_op(graph, mesh, method, inputs=inputs, blocks=blocks, memo=memo,
                             deadline=deadline, sharing=sharing, start_from=start)
    except InfeasibleError as e:
        return e


def _unfit_text(error: Exception) -> str:
    """How the notes list a view that does not fit: by its ILPs, or by its memory floor."""
    from torchalpa.passes.sharding.view_floor import FloorRefusal
    return "does not fit (its memory floor, no ILP)" if isinstance(error, FloorRefusal) \
        else "does not fit"


def _chosen(plans: list, skipped: list, late: list, meshes: list[LogicalMesh]) -> Plan:
    """The fastest of ``plans``, logged, with the meshes' notes."""
    best = min(plans, key=lambda p: p.estimates.step_time_s)
    log.info("chose mesh %s: %s", "x".join(map(str, best.mesh_shape)),
             _estimate_text(best, meshes[0]))
    return _with_mesh_notes(best, plans, skipped, late, len(meshes))


def _with_budget(found: Plan, method: ShardParallel, mesh: LogicalMesh) -> Plan:
    """``found`` with the memory budget it was planned for recorded (reports, pictures)."""
    budget = method.auto_sharding_option.memory_budget_per_device or mesh.memory_per_device
    if not budget:
        return found
    return replace(found, estimates=replace(found.estimates,
                                            memory_budget_per_device_bytes=budget))


def _shape(mesh: LogicalMesh) -> str:
    return "x".join(map(str, mesh.shape))


def _bound_above(graph: OpGraph, mesh: LogicalMesh, method: ShardParallel, inputs: str,
                 memo, fastest: Plan, blocks: dict | None) -> str | None:
    """Why ``mesh`` is not solved: its step-time bound (the LP relaxation of the problems
    its ILP solves with ``blocks``) is above the plan ``fastest`` found; None where it is
    not."""
    from torchalpa.passes.sharding.intra_op import step_time_lower_bound
    bound = step_time_lower_bound(graph, mesh, method, inputs=inputs, memo=memo,
                                  blocks=blocks)
    if bound is not None and bound > known(fastest.estimates.step_time_s) * (1 + 1e-9):
        return f">= {bound * 1e3:.3g} ms (bound, not solved)"
    return None


def _cached(key: str, graph: OpGraph, fingerprint: str, mesh: LogicalMesh):
    """The plan cached under ``key`` for ``graph`` on ``mesh``, or None."""
    return cache.load_cached(key, lambda p, source: check_plan(
        p, fingerprint=fingerprint, source=source, mesh_shape=tuple(mesh.shape), graph=graph))


def _solve_apart(graph: OpGraph, method: ShardParallel, meshes: list[LogicalMesh], inputs: str,
                 blocks: dict | None, memo, deadline: float | None, workers: int, profile,
                 fingerprint: str, skip: dict[int, str], sharing: dict | None = None,
                 starts: dict[int, Plan] | None = None) -> dict[int, Any]:
    """mesh index -> its plan, or the InfeasibleError its ILP (or its memory floor, in the
    worker) raised, for the meshes
    ``plan_graph`` would solve (not skipped, cached or refused by the memory bound), solved in
    up to ``workers`` forked processes (``stage_jobs.fork_map``), the 2D views (the longest
    solves) first. Each solve is ``_solved``, what ``plan_graph`` runs one after another, bounded
    by the same work, so the plans are the same; pricing memos filled in a worker stay there.
    The first mesh solves without a deadline (no plan is in hand before it), the others
    with it, as one after another. Empty where fewer than two meshes are left to solve.
    ``sharing`` is updated with each worker's answer in ``meshes``' order (each mesh has
    its own entries, so the order of the answers does not matter)."""
    from torchalpa.passes.pipeline_search.stage_jobs import can_fork, fork_map
    from torchalpa.passes.sharding.intra_op import sharing_key
    todo = [i for i, mesh in enumerate(meshes)
            if i not in skip and memory_refusal(profile, mesh, method) is None and not isinstance(_cached(
                cache.plan_key(fingerprint, mesh, method, inputs), graph, fingerprint, mesh),
                Plan)]
    if len(todo) < 2 or not can_fork() or \
            (deadline is not None and time.perf_counter() > deadline):
        return {}

    def solve(i: int):
        found = None if sharing is None else dict(sharing)
        return _solved(graph, meshes[i], method, inputs, blocks, memo, found,
                       None if i == todo[0] else deadline, (starts or {}).get(i)), found

    order = sorted(todo, key=lambda i: (-len(meshes[i].shape), i))
    shapes = ", ".join("x".join(map(str, meshes[i].shape)) for i in order)
    with step(f"meshes {shapes} solving in {min(workers, len(order))} processes") as progress:
        found = fork_map(solve, order, workers, unit="views")
        progress.done = "done"
    if sharing is not None:
        for i, (_, theirs) in sorted(zip(order, found)):
            key = sharing_key(meshes[i])
            if theirs is not None and key in theirs:
                sharing[key] = sharing.get(key, frozenset()) | theirs[key]
    return {i: plan for i, (plan, _) in zip(order, found)}


def _no_mesh_fits(failures: list, refused: list[LogicalMesh], meshes: list[LogicalMesh],
                  profile, method: ShardParallel, advise: Callable[[], str]) -> Exception:
    """The error when no mesh has a plan: each mesh's reason, and what would fit
    (``advise``: asked where a view did not fit its memory, not where it was cut short,
    and not for a caller that keeps only that none fits: ``least_memory_unsaid``, as
    AutoParallel's candidates, which says what would fit itself)."""
    from torchalpa.passes.sharding.ilp import InfeasibleError
    from torchalpa.passes.sharding.intra_op import least_memory_said
    over = refused or any(_over_memory(e) for e in failures)
    advice = advise() if over and least_memory_said() else ""
    if len(refused) == len(meshes) and len({m.num_devices for m in meshes}) == 1:
        views = ", ".join("x".join(map(str, m.shape)) for m in meshes)
        return InfeasibleError(f"{failures[0]} (every view of its {meshes[0].num_devices} "
                               f"devices shares this bound: {views}){advice}")
    if len(failures) == 1:
        error = InfeasibleError(f"{failures[0]}{advice}")
        error.__cause__ = failures[0]
        return error
    return InfeasibleError("no logical mesh fits the memory budget:\n"
                           + "\n".join(f"  {e}" for e in failures) + advice)


def _with_mesh_notes(best: Plan, plans: list[Plan], skipped: list, late: list,
                     num_meshes: int) -> Plan:
    """``best`` with a note of every mesh tried (estimate, bound, does not fit -- by its
    ILPs or its memory floor -- or not solved in time)
    and, when the time budget left meshes unsolved, the safety net's note."""
    from torchalpa.passes.sharding.ilp import CLOCK_NOTE
    if num_meshes > 1:
        tried = ", ".join(f"{'x'.join(map(str, p.mesh_shape))}: "
                          f"{known(p.estimates.step_time_s) * 1e3:.3g} ms" for p in plans)
        tried += "".join(f", {'x'.join(map(str, m.shape))}: {why}" for m, why in skipped)
        tried += "".join(f", {'x'.join(map(str, m.shape))}: not solved (time budget)"
                         for m in late)
        best = replace(best, notes=best.notes + (f"logical meshes tried (estimated step): {tried}",))
    if late and not clock_stopped(best):
        unsolved = ", ".join("x".join(map(str, m.shape)) for m in late)
        best = replace(best, notes=best.notes + (
            f"{CLOCK_NOTE} the search: meshes {unsolved} were not solved; a faster or idler "
            "machine may find a better plan",))
    return best


def clock_stopped(plan) -> bool:
    """Whether a time limit (a safety net), not the work bounds, cut ``plan``'s search
    short: such a plan depends on the machine's speed (its notes say how)."""
    from torchalpa.passes.sharding.ilp import CLOCK_NOTE
    return any(n.startswith(CLOCK_NOTE) for n in plan.notes)


def _budget(method: ShardParallel, mesh: LogicalMesh) -> float | None:
    return method.auto_sharding_option.memory_budget_per_device or mesh.memory_per_device


def _replicated_state(method: ShardParallel) -> bool:
    option = method.auto_sharding_option
    return option.parameters == "replicated" or option.force_data_parallel


def memory_refusal(profile, mesh: LogicalMesh, method: ShardParallel):
    """An ``OverMemoryBudget`` error when no plan of the step can fit ``mesh``'s memory
    budget by the step's lower bound (``passes/pricing/bounds.py``), else None: the ILP is
    not worth building."""
    from torchalpa.passes.sharding.ilp import OverMemoryBudget
    budget = _budget(method, mesh)
    if not budget:
        return None
    devices = mesh.num_devices
    need = profile.memory_bytes(devices, replicated_parameters=_replicated_state(method))
    if need <= budget:
        return None
    spread = 1 if _replicated_state(method) else devices
    states = profile.state_bytes / spread
    # the step's end binds (the optimizer's temporaries), or the activations' peak
    at_end = need <= (profile.state_bytes + profile.optimizer_temporary_bytes) / spread
    what = "of the optimizer update's temporaries at the step's end" if at_end else \
        "of activations at the step's peak"
    shape = "x".join(map(str, mesh.shape))
    return OverMemoryBudget(
        f"the model does not fit in {format_bytes(budget)} per device on mesh {shape}: "
        f"every plan needs at least {format_bytes(need)} per device ({format_bytes(states)} "
        f"of parameters, gradients and optimizer states and "
        f"{format_bytes(need - states)} {what}, split over "
        f"all {devices} devices; a lower bound, no solver run)")


def _over_memory(error: Exception) -> bool:
    """Whether a view's error says a plan does not fit its memory (its bound, its floor or
    its ILPs), not that it had no answer in time or no strategy."""
    from torchalpa.passes.sharding.ilp import OverMemoryBudget
    return isinstance(error, OverMemoryBudget)


def fitting_advice(profile, meshes: list[LogicalMesh], method: ShardParallel, graph: OpGraph,
                   inputs: str = "global") -> str:
    """What would fit: checkpointing and micro-batches by the step's bound, devices and
    memory by the views' memory floors (``fit_advice``)."""
    from torchalpa.parallel.fit_advice import fit_advice
    budget = _budget(method, meshes[0])
    if not budget:
        return ""
    devices, replicated = meshes[0].num_devices, _replicated_state(method)
    lines = ["\nwhat could fit:",
             "  activation checkpointing: AutoShardingOption(remat='full' or 'selective') "
             "keeps a fraction of the activations"]
    batch = profile.batch
    for k in range(2, batch + 1):
        need = profile.memory_bytes(devices, batch // k, replicated_parameters=replicated)
        if batch % k == 0 and need <= budget:
            lines.append(f"  gradient accumulation: num_micro_batches={k} (micro-batches of "
                         f"{batch // k}) needs at least {format_bytes(need)} (the step's "
                         "memory bound)")
            break
    advice = fit_advice(graph, meshes, method, inputs=inputs, scan=not replicated,
                        bound_devices=profile.devices_to_fit(budget))
    if advice is not None and not replicated:    # more devices: the same states on each
        lines.append(f"  devices, the step as it is: {advice.devices_text()}")
    if advice is not None:
        lines.append(f"  memory: {advice.memory_text()}")
    lines.append("  or leave method= out: the default (torchalpa.AutoParallel) weighs "
                 "checkpointing, micro-batches and pipelines for you")
    return "\n".join(lines)


def _estimate_text(plan: Plan, mesh: LogicalMesh) -> str:
    """``est 630 ms/step, 45.5 GiB of 74.5``: a plan's estimates against the budget."""
    est = plan.estimates
    text = f"est {(est.step_time_s or 0) * 1e3:.3g} ms/step"
    memory = est.memory_per_device_bytes
    if memory is not None:
        text += f", {format_bytes(memory)}"
        budget = est.memory_budget_per_device_bytes or mesh.memory_per_device
        if budget:
            text += f" of {format_bytes(budget)}"
    return text


def blocks_of(graph: OpGraph) -> dict | None:
    """Repeated layers the frontend tagged, if it found any."""
    return graph.meta.get("repeated_blocks") or None


@dataclass(frozen=True)
class IntraOpTarget:
    """What an intra-op plan is made for: the cluster, the logical meshes to try, the mesh
    shape asked for (by ``mesh=`` or the method; None: any), and the DeviceMesh the user
    gave ``auto_parallel`` (None: built from the plan's mesh)."""

    cluster: Cluster | LogicalMesh
    meshes: list[LogicalMesh]
    shape: tuple[int, ...] | None = None
    device_mesh: Any = None


def check_device_mesh(mesh) -> None:
    """A TypeError unless ``mesh`` (``auto_parallel``'s ``mesh=``) is a torch DeviceMesh;
    a shape is the method's ``logical_mesh_shape``."""
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh over every rank (e.g. "
                        f"init_device_mesh('cuda', (2, 4))), got {type(mesh).__name__} "
                        f"{mesh!r}; to view the devices as a shape, pass "
                        "ShardParallel(logical_mesh_shape=...) as method=")


class IntraOpSteps:
    """``MethodSteps``, ``GenerationSteps`` and ``ProgramSteps`` of ShardParallel and its
    presets (``torchalpa.parallel.steps``)."""

    def with_options(self, method: ShardParallel, *, inputs: str = "global", signature=None,
                     mesh=None, num_micro_batches: int | None = None, init_weights=None
                     ) -> ShardParallel:
        del inputs, signature, mesh, init_weights      # every one is honoured
        return with_micro_batches(method, num_micro_batches)     # priced as it runs

    def target(self, method: ShardParallel, *, cluster, mesh, world: int,
               live: bool) -> IntraOpTarget:
        shape = names = None
        if mesh is not None:
            check_device_mesh(mesh)
            if mesh.size() != world:
                raise ValueError(f"the mesh has {mesh.size()} devices but this job has {world} "
                                 "ranks; torchalpa needs a mesh over all ranks")
            shape = tuple(mesh.shape)
            names = tuple(mesh.mesh_dim_names or (f"axis{i}" for i in range(len(shape))))
            if method.logical_mesh_shape and tuple(method.logical_mesh_shape) != shape:
                raise ValueError(f"method.logical_mesh_shape {method.logical_mesh_shape} "
                                 f"differs from the mesh's shape {shape}")
        elif method.logical_mesh_shape and live:     # the job's world must fit the mesh
            from torchalpa.runtime.execution.mesh import check_world_size
            shape = tuple(method.logical_mesh_shape)
            check_world_size(shape)
        cluster = cluster or default_cluster(world, measure=live)
        return IntraOpTarget(cluster, candidate_meshes(cluster, method, shape, names), shape,
                             mesh)

    def solve(self, graph: OpGraph, target: IntraOpTarget, method: ShardParallel,
              inputs: str, measured=None) -> Plan:
        del measured
        if method.auto_sharding_option.offload_parameters:   # room for the streamed copies
            from torchalpa.parallel.offload import with_streaming_room
            method = with_streaming_room(method, graph, target.cluster)
        plan = plan_graph(graph, method=method, meshes=target.meshes, inputs=inputs,
                          blocks=blocks_of(graph))
        if method.auto_sharding_option.offload:      # priced and checked on the host
            from torchalpa.parallel.offload import with_offload
            plan = with_offload(plan, graph, target.cluster, method)
        return plan

    def plan_program(self, program, example_inputs, *, method: ShardParallel, cluster,
                     inputs: str, param_argnums, num_params) -> Plan:
        from torchalpa.interop.programs import program_graph
        graph = program_graph(program, example_inputs, param_argnums=param_argnums,
                              num_params=num_params)
        return plan_graph(graph, method=method, inputs=inputs,
                          meshes=candidate_meshes(cluster or default_cluster(1), method))

    def measure(self, captured, target, method, example_inputs, model, device) -> None:
        return None

    def check_plan_kind(self, plan) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a torchalpa.Plan, got {type(plan).__name__}")

    def check_given_plan(self, plan: Plan, graph: OpGraph, target: IntraOpTarget) -> None:
        check_plan(plan, fingerprint=graph.fingerprint(), source="the plan passed as plan=",
                   mesh_shape=target.shape, graph=graph)

    def for_generation(self, method: ShardParallel) -> ShardParallel:
        if method.num_micro_batches != 1:
            raise ValueError("mode='inference' generates a batch at once: num_micro_batches "
                             "must be 1")
        return method

    def solve_pinned(self, graph: OpGraph, plan: Plan, target: IntraOpTarget,
                     method: ShardParallel, inputs: str) -> Plan:
        mesh = candidate_meshes(target.cluster, method, tuple(plan.mesh_shape),
                                tuple(plan.axis_names))[0]
        return plan_pinned(graph, plan, method, mesh, inputs)

    def place_forward(self, plan: Plan, target: IntraOpTarget, method: ShardParallel,
                      device) -> PlacedForward:
        device_mesh, lower_program = _lowering(plan, target, device)
        return PlacedForward(mesh=device_mesh, lower=lambda gm, p, updates: lower_program(
            gm, p, [], updates).forward)

    def place(self, captured, plan: Plan, target: IntraOpTarget, method: ShardParallel, device,
              *, model, traced, loss_fn, inputs: str, signature) -> Placed:
        from torchalpa.runtime.execution.materialize import distribute_module_state
        from torchalpa.runtime.rewrites.program_rewrites import step_programs
        device_mesh, lower_program = _lowering(plan, target, device)
        program = lower_program(captured.gm, plan, captured.param_names,
                                captured.buffer_updates, captured.buffer_names,
                                method.num_micro_batches)
        logical_mesh = candidate_meshes(target.cluster, method, tuple(plan.mesh_shape),
                                        tuple(plan.axis_names))[0]
        forward_programs = _forward_programs(
            traced, loss_fn, plan, method, logical_mesh, inputs,
            lambda gm, p, updates: lower_program(gm, p, [], updates).forward, signature)

        def distribute(init_weights) -> None:
            distribute_module_state(model, plan, device_mesh, device, init_weights=init_weights)

        return Placed(program=step_programs(program, plan,
                                            num_micro_batches=method.num_micro_batches,
                                            one_stage=True),
                      mesh=device_mesh, distribute=distribute,
                      num_micro_batches=method.num_micro_batches,
                      forward_programs=forward_programs,
                      description=captured.graph.summary())


def _lowering(plan: Plan, target: IntraOpTarget, device):
    """This rank's DeviceMesh for ``plan`` (the user's, or one of the plan's shape) and
    ``lower_program(gm, plan, param_names, buffer_updates, buffer_names, micro)``."""
    from torchalpa.runtime.execution import mesh as mesh_mod
    from torchalpa.runtime.lowering.lower import lower
    device_mesh = target.device_mesh if target.device_mesh is not None else \
        mesh_mod.build_mesh(plan.mesh_shape, plan.axis_names)
    coords = device_mesh.get_coordinate()
    groups = [device_mesh.get_group(i).group_name for i in range(device_mesh.ndim)]

    def lower_program(gm, a_plan, param_names, buffer_updates=(), buffer_names=(), micro=1):
        return lower(gm, a_plan, param_names, coords=coords, group_names=groups,
                     device=device, buffer_updates=buffer_updates,
                     buffer_names=buffer_names, num_micro_batches=micro)

    return device_mesh, lower_program


def plan_pinned(graph: OpGraph, plan: Plan, method: ShardParallel, mesh: LogicalMesh,
                inputs: str) -> Plan:
    """``graph`` planned on ``mesh`` (``plan``'s) with every parameter and buffer ``plan``
    names held to its layout there; rank 0 plans, every rank gets the plan."""
    from torchalpa.runtime.serving.inference import pins_of
    option = replace(method.auto_sharding_option,
                     pin=tuple(method.auto_sharding_option.pin) + pins_of(plan))
    pinned = replace(method, auto_sharding_option=option)
    same_step_on_every_rank(graph.fingerprint())
    return plan_on_rank0(lambda: plan_graph(graph, method=pinned, meshes=[mesh], inputs=inputs,
                                            blocks=blocks_of(graph)))


# -- auto_parallel's runtime options ----------------------------------------------------

def _forward_programs(traced, loss_fn, training_plan: Plan, method: ShardParallel,
                      logical_mesh: LogicalMesh, inputs: str, lower_forward, signature=None):
    """Forward-only programs (predict, eval mode) planned with the training layouts pinned."""
    from torchalpa.frontends.torch_export import capture_forward
    from torchalpa.runtime.serving.inference import ForwardPrograms

    def plan_forward(graph: OpGraph) -> Plan:
        return plan_pinned(graph, training_plan, method, logical_mesh, inputs)

    return ForwardPrograms(traced, loss_fn, training_plan, plan_forward, lower_forward,
                           capture_forward, signature=signature)
