"""PipeshardParallel's steps: pipeline stages on submeshes.

The step is captured for one micro-batch (the global batch's dim 0 divided by
``num_micro_batches``), rank 0 plans it (layers, stages, each stage's intra-op plan) and
broadcasts the plan, every rank builds every stage's DeviceMesh (creating process groups
takes all ranks), then lowers and runs its own stage. ``PipelineSteps`` is what the
orchestration (``torchalpa.parallel.build``) asks.
"""

from __future__ import annotations

import logging

import torch

from torchalpa.core.cluster import Cluster
from torchalpa.core.options import PipeshardParallel, with_micro_batches
from torchalpa.core.plan import PipelinePlan
from torchalpa.core.plan_check import check_plan
from torchalpa.core.progress import step
from torchalpa.parallel import cache
from torchalpa.parallel.steps import Placed
from torchalpa.parallel.workflow import default_cluster, micro_batch_examples

__all__ = ["PipelineSteps", "pipeline_options"]

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


def _cached(graph, cluster: Cluster, method: PipeshardParallel, inputs: str, solve):
    """The plan cached for this (graph, cluster, method), else ``solve()`` (then cached).
    Profiled plans depend on measurements and are never cached."""

    def solve_and_say():
        with step(f"pipeline stages for {cluster.num_nodes}x{cluster.devices_per_node} "
                  "devices solving") as progress:
            plan = solve()
            progress.done = (f"{len(plan.stages)} stages, est "
                             f"{(plan.estimates.step_time_s or 0) * 1e3:.3g} ms/step")
        return plan

    if method.stage_option == "profile":
        return solve_and_say()
    fingerprint = graph.fingerprint()
    key = cache.plan_key(fingerprint, cluster, method, inputs)
    found = cache.load_cached(key, lambda p, source: check_plan(
        p, fingerprint=fingerprint, source=source))
    if isinstance(found, PipelinePlan):
        log.info("pipeline plan from the cache: %d stages, est %.3g ms/step", len(found.stages),
                 (found.estimates.step_time_s or 0) * 1e3)
        return found
    plan = solve_and_say()
    from torchalpa.parallel.shard import clock_stopped
    if not clock_stopped(plan):      # a plan the clock cut short is not what the key promises
        cache.store(key, plan)
        cache.trim()
    return plan


class PipelineSteps:
    """``MethodSteps`` of PipeshardParallel (``torchalpa.parallel.steps``): the target is a
    cluster cut into submeshes; each rank runs its stage's program."""

    def with_options(self, method: PipeshardParallel, *, inputs: str = "global",
                     signature=None, mesh=None, num_micro_batches: int | None = None,
                     init_weights=None) -> PipeshardParallel:
        return pipeline_options(method, by_keyword=signature is not None and
                                signature.by_keyword, mesh=mesh, inputs=inputs,
                                num_micro_batches=num_micro_batches, init_weights=init_weights)

    def target(self, method: PipeshardParallel, *, cluster, mesh, world: int,
               live: bool) -> Cluster:
        del method, mesh
        cluster = _check_cluster(cluster or default_cluster(world))
        if live and cluster.num_devices != world:
            raise ValueError(f"the cluster has {cluster.num_devices} devices but this job has "
                             f"{world} ranks; launch with torchrun --nproc_per_node="
                             f"{cluster.num_devices} or describe the cluster this job runs on")
        return cluster

    def solve(self, graph, target: Cluster, method: PipeshardParallel, inputs: str,
              measured=None) -> PipelinePlan:
        from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
        return _cached(graph, target, method, inputs, lambda: plan_pipeline(
            graph, target, method, inputs=inputs, measured=measured))

    def measure(self, captured, target: Cluster, method: PipeshardParallel, example_inputs,
                model, device):
        if method.stage_option != "profile":
            return None
        return _profile(captured, target, method, example_inputs, model, device)

    def check_plan_kind(self, plan) -> None:
        if not isinstance(plan, PipelinePlan):
            raise ValueError("the given plan is not a pipeline plan for this training step; "
                             "plan again, or pass plan=None to solve now")

    def check_given_plan(self, plan: PipelinePlan, graph, target: Cluster) -> None:
        self.check_plan_kind(plan)
        if plan.graph_fingerprint != graph.fingerprint():
            raise ValueError("the given plan is not a pipeline plan for this training step; "
                             "plan again, or pass plan=None to solve now")

    def place(self, captured, plan: PipelinePlan, target: Cluster, method, device, *, model,
              traced, loss_fn, inputs: str, signature) -> Placed:
        from torch.distributed.device_mesh import DeviceMesh

        from torchalpa.runtime.execution import mesh as mesh_mod
        from torchalpa.runtime.execution.materialize import distribute_stages
        from torchalpa.runtime.execution.pipeline import StageExchange, lower_stage, transfer_specs
        from torchalpa.runtime.rewrites.program_rewrites import step_programs
        del target, method, traced, loss_fn, inputs, signature
        rank = mesh_mod.rank()
        meshes = [DeviceMesh(device.type, torch.tensor(st.ranks).reshape(st.plan.mesh_shape),
                             mesh_dim_names=tuple(st.plan.axis_names)) for st in plan.stages]
        stage = plan.stage_of_rank(rank)
        mesh = meshes[stage.index]
        program = lower_stage(
            captured.gm, plan, stage.index, param_names=captured.param_names,
            buffer_names=captured.buffer_names, buffer_updates=captured.buffer_updates,
            coords=mesh.get_coordinate(), group_names=[mesh.get_group(i).group_name
                                                       for i in range(mesh.ndim)], device=device)
        exchange = StageExchange(
            plan, stage.index, rank, transfer_specs(captured.gm, plan), device,
            gather_group=mesh.get_group(mesh.ndim - 1) if mesh.shape[-1] > 1 else None,
        ) if len(plan.stages) > 1 else None

        def distribute(init_weights) -> None:
            assert init_weights is None, "pipeline_options refuses init_weights"
            distribute_stages(model, [(st.plan, meshes[st.index]) for st in plan.stages], device)

        return Placed(program=step_programs(program, stage.plan,
                                            num_micro_batches=plan.num_micro_batches,
                                            one_stage=len(plan.stages) == 1),
                      mesh=mesh, distribute=distribute,
                      num_micro_batches=plan.num_micro_batches, stage=stage.index,
                      runner_options=dict(schedule=plan.schedule, num_stages=len(plan.stages),
                                          stage=stage.index, exchange=exchange,
                                          remat=stage.recompute),
                      description=f"stage {stage.index} of {len(plan.stages)} on ranks "
                                  f"{list(stage.ranks)}")


def _profile(captured, cluster: Cluster, method: PipeshardParallel, example_inputs, model,
             device) -> dict:
    """Rank 0 builds the layer probes; every rank takes part in timing them."""
    from torchalpa.passes.pipeline_search.inter_op import LayerProbe, layer_probes
    from torchalpa.runtime.execution.mesh import on_rank0
    from torchalpa.runtime.measurement.profile import profile_layers
    items = on_rank0(lambda: [(p.key, p.layer, p.plan.to_json(indent=None), p.stage)
                                   for p in layer_probes(captured.graph, cluster, method)],
                          "building the layer probes")
    probes = [LayerProbe(key, layer, PipelinePlan.from_json(text), stage)
              for key, layer, text, stage in items]
    micro = micro_batch_examples(example_inputs, method.num_micro_batches)
    return profile_layers(captured, probes, micro, model, device)
