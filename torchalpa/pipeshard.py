"""``auto_parallel`` / ``plan`` for PipeshardParallel: pipeline stages on submeshes.

The step is captured for one micro-batch (the global batch's dim 0 divided by
``num_micro_batches``), rank 0 plans it (layers, stages, each stage's intra-op plan) and
broadcasts the plan, every rank builds every stage's DeviceMesh (creating process groups
takes all ranks), then lowers and runs its own stage.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

import torch
import torch.nn as nn

from torchalpa.cluster import Cluster
from torchalpa.methods import PipeshardParallel, with_micro_batches
from torchalpa.plan import PipelinePlan
from torchalpa.workflow import (capture_variants, default_cluster, micro_batch_examples,
                                plan_on_rank0, same_step_on_every_rank, with_precision)

__all__ = ["plan_pipeshard", "pipeshard_parallel", "pipeline_options"]

log = logging.getLogger("torchalpa")


def _check_cluster(cluster: Cluster) -> Cluster:
    if not isinstance(cluster, Cluster):
        raise TypeError("PipeshardParallel plans for a torchalpa.Cluster (nodes x devices), "
                        f"got {type(cluster).__name__}")
    return cluster


def pipeline_options(method: PipeshardParallel, *, by_keyword: bool = False, mesh=None,
                     inputs: str = "global", num_micro_batches: int | None = None,
                     init_weights=None) -> PipeshardParallel:
    """``method`` with ``auto_parallel``'s options applied, or a ValueError naming an option
    a pipeline cannot honour and what to do instead.

    ``num_micro_batches`` means what it means for ShardParallel (a step's micro-batches,
    their gradients summed, their losses averaged): given, it sets the method's (when that
    is the default 1) or must equal it.
    """
    if by_keyword:
        raise ValueError("PipeshardParallel takes positional example inputs; pass a tuple "
                         "of tensors (or wrap the model to call it by keyword)")
    if mesh is not None:
        raise ValueError("PipeshardParallel builds one DeviceMesh per stage from the plan's "
                         "submeshes, so it takes no mesh=; describe the hardware with "
                         "cluster=torchalpa.Cluster(...), or fix stages and their meshes with "
                         "stage_option=ManualStageOption(submesh_shapes=..., logical_shapes=...)")
    if inputs != "global":
        raise ValueError("PipeshardParallel needs inputs='global': the first stage's ranks read "
                         "every micro-batch's inputs and the last stage's ranks its targets, so "
                         "each rank's own shard (inputs='local', a DistributedSampler) would "
                         "leave them without the data other ranks hold; pass the same global "
                         "batch on every rank")
    if init_weights is not None:
        raise ValueError("init_weights= is not supported with PipeshardParallel: pipeline "
                         "stages take the model's real weights (build the model on CPU and "
                         "initialize it before auto_parallel)")
    return with_micro_batches(method, num_micro_batches)


def plan_pipeshard(model: nn.Module, example_inputs, loss_fn, *, method: PipeshardParallel,
                   cluster: Cluster | None, inputs: str = "global") -> PipelinePlan:
    """The pipeline plan, without processes or real weights."""
    from torchalpa.programs import is_program
    if is_program(model):
        raise ValueError("a JAX function or StableHLO program is planned whole with "
                         "ShardParallel: PipeshardParallel cuts a torch model's step into stages")
    method = pipeline_options(method, inputs=inputs)
    if cluster is None:
        from torchalpa.runtime.mesh import world_size
        cluster = default_cluster(world_size())
    from torchalpa.passes.inter_op import plan_pipeline
    from torchalpa.passes.remat_choice import plan_with_remat
    micro = micro_batch_examples(example_inputs, method.num_micro_batches)
    variants = capture_variants(model, micro, loss_fn, method.auto_sharding_option)
    return plan_with_remat(variants, lambda c: _cached(
        c.graph, _check_cluster(cluster), method, inputs,
        lambda: plan_pipeline(c.graph, cluster, method, inputs=inputs)), lambda c: c.graph)


def _cached(graph, cluster: Cluster, method: PipeshardParallel, inputs: str, solve):
    """The plan cached for this (graph, cluster, method), else ``solve()`` (then cached).
    Profiled plans depend on measurements and are never cached."""
    from torchalpa import cache
    from torchalpa.progress import step

    def solve_and_say():
        with step(f"pipeline stages for {cluster.num_nodes}x{cluster.devices_per_node} "
                  "devices solving") as progress:
            plan = solve()
            progress.done = (f"{len(plan.stages)} stages, est "
                             f"{plan.estimates.get('step_time_s', 0) * 1e3:.3g} ms/step")
        return plan

    if method.stage_option == "profile":
        return solve_and_say()
    from torchalpa.plan_check import check_plan
    fingerprint = graph.fingerprint()
    key = cache.plan_key(fingerprint, cluster, method, inputs)
    found = cache.load_cached(key, lambda p, source: check_plan(
        p, fingerprint=fingerprint, source=source))
    if isinstance(found, PipelinePlan):
        log.info("pipeline plan from the cache: %d stages, est %.3g ms/step", len(found.stages),
                 found.estimates.get("step_time_s", 0) * 1e3)
        return found
    plan = solve_and_say()
    cache.store(key, plan)
    cache.trim()
    return plan


def pipeshard_parallel(model: nn.Module, example_inputs, loss_fn, *, method: PipeshardParallel,
                       cluster: Cluster | None = None, optimizer: Callable | None = None,
                       plan: PipelinePlan | None = None, mixed_precision=None,
                       compile: bool | dict = False, signature=None,
                       check_replicas: bool | None = None, check_inputs: str = "first",
                       **options):
    """Each rank's stage of ``method``'s pipeline plan, as a ``ParallelModule``.
    ``compile``: the stage's programs run under ``torch.compile`` (a dict: its options);
    ``check_replicas`` / ``check_inputs``: as for ShardParallel (replicas compared over
    the stage's mesh, every rank's global batch against rank 0's); ``options``: the rest
    of ``auto_parallel``'s, applied by ``pipeline_options``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torchalpa.passes.inter_op import plan_pipeline
    from torchalpa.runtime import mesh as mesh_mod
    from torchalpa.runtime.module import ParallelModule
    from torchalpa.runtime.pipeline import StageExchange, lower_stage, transfer_specs
    from torchalpa.runtime.step import StepRunner

    method = pipeline_options(method, by_keyword=signature is not None and signature.by_keyword,
                              **options)
    mesh_mod.init_distributed()
    world, rank = mesh_mod.world_size(), mesh_mod.rank()
    cluster = _check_cluster(cluster or default_cluster(world))
    if cluster.num_devices != world:
        raise ValueError(f"the cluster has {cluster.num_devices} devices but this job has {world} "
                         f"ranks; launch with torchrun --nproc_per_node={cluster.num_devices} or "
                         "describe the cluster this job runs on")
    start = time.perf_counter()
    traced = with_precision(model, mixed_precision)
    from torchalpa.passes.remat_choice import chosen_remat, plan_with_remat
    option = method.auto_sharding_option
    if plan is not None and isinstance(plan, PipelinePlan):
        option = replace(option, remat=chosen_remat(plan))   # capture what the plan was made for
    variants = capture_variants(traced, micro_batch_examples(
        example_inputs, method.num_micro_batches), loss_fn, option)
    captured = next(iter(variants.values()))
    fingerprint = captured.graph.fingerprint()
    same_step_on_every_rank(fingerprint)
    if plan is not None:
        if not isinstance(plan, PipelinePlan) or plan.graph_fingerprint != fingerprint:
            raise ValueError("the given plan is not a pipeline plan for this training step; "
                             "plan again, or pass plan=None to solve now")
        the_plan = plan
    else:
        measured = None
        if method.stage_option == "profile":
            measured = _profile(captured, cluster, method, example_inputs, model,
                                mesh_mod.default_device())
        the_plan = plan_on_rank0(lambda: plan_with_remat(variants, lambda c: _cached(
            c.graph, cluster, method, "global",
            lambda: plan_pipeline(c.graph, cluster, method, measured=measured)),
            lambda c: c.graph))
        captured = variants[chosen_remat(the_plan)]
    device = mesh_mod.default_device()
    meshes = [DeviceMesh(device.type, torch.tensor(st.ranks).reshape(st.plan.mesh_shape),
                         mesh_dim_names=tuple(st.plan.axis_names)) for st in the_plan.stages]
    stage = the_plan.stage_of_rank(rank)
    mesh = meshes[stage.index]
    program = lower_stage(
        captured.gm, the_plan, stage.index, param_names=captured.param_names,
        buffer_names=captured.buffer_names, buffer_updates=captured.buffer_updates,
        coords=mesh.get_coordinate(), group_names=[mesh.get_group(i).group_name
                                                   for i in range(mesh.ndim)], device=device)
    if compile:
        program = program.compiled(**(compile if isinstance(compile, dict) else {}))
    from torchalpa.runtime.materialize import distribute_stages
    distribute_stages(model, [(st.plan, meshes[st.index]) for st in the_plan.stages], device)
    exchange = StageExchange(the_plan, stage.index, rank, transfer_specs(captured.gm, the_plan),
                             device) if len(the_plan.stages) > 1 else None
    runner = StepRunner(program, the_plan.num_micro_batches, schedule=the_plan.schedule,
                        num_stages=len(the_plan.stages), stage=stage.index, exchange=exchange,
                        recompute=stage.recompute)
    from torchalpa.runtime.random import sync_random_state
    sync_random_state(device)    # replicas of a stage draw alike (runtime/random.py)
    log.info("pipeline ready in %.2fs: stage %d of %d on ranks %s", time.perf_counter() - start,
             stage.index, len(the_plan.stages), list(stage.ranks))
    return ParallelModule(model, the_plan, runner, mesh, stage=stage.index,
                          input_specs=[(tuple(x.shape), x.dtype) for x in example_inputs],
                          device=device, optimizer=optimizer,
                          check_replicas=check_replicas, check_inputs=check_inputs)


def _profile(captured, cluster: Cluster, method: PipeshardParallel, example_inputs, model,
             device) -> dict:
    """Rank 0 builds the layer probes; every rank takes part in timing them."""
    from torchalpa.passes.inter_op import LayerProbe, layer_probes
    from torchalpa.plan import PipelinePlan
    from torchalpa.runtime.mesh import on_rank0
    from torchalpa.runtime.profile import profile_layers
    items = on_rank0(lambda: [(p.key, p.layer, p.plan.to_json(indent=None), p.stage)
                                   for p in layer_probes(captured.graph, cluster, method)],
                          "building the layer probes")
    probes = [LayerProbe(key, layer, PipelinePlan.from_json(text), stage)
              for key, layer, text, stage in items]
    micro = micro_batch_examples(example_inputs, method.num_micro_batches)
    return profile_layers(captured, probes, micro, model, device)
