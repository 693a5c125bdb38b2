"""The public steps every parallel method takes from a model to a parallel module.

``capture_step`` (the training step as a graph, for one micro-batch) ->
``same_step_on_every_rank`` -> ``plan_on_rank0`` (rank 0 solves, every rank gets the
plan) -> the method's runtime. ``shard`` (intra-op plans) and ``pipeshard`` (pipeline
plans) both call these, so micro-batch splitting, capture and planning on rank 0 exist once.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TypeVar, cast

import torch

from torchalpa.core.cluster import Cluster, cuda_selected
from torchalpa.core.plan import PipelinePlan, Plan
from torchalpa.core.units import format_count
from torchalpa.parallel.calibrate import calibration_enabled, measure_cluster
from torchalpa.parallel.device_profile import apply_profile, load_profile

__all__ = ["planning_gc", "default_cluster", "capture_step", "capture_variants", "micro_batch_examples",
           "capture_examples", "with_precision", "with_precision_recorded",
           "same_step_on_every_rank", "plan_on_rank0"]

log = logging.getLogger("torchalpa")

AnyPlan = TypeVar("AnyPlan", bound=Plan | PipelinePlan)


GC_YOUNG_THRESHOLD = 20_000
"""Allocations between collections of the youngest generation while planning (Python's
default: 700)."""

_planning = 0      # planning_gc's depth: only the outermost changes the collector


@contextmanager
def planning_gc() -> Iterator[None]:
    """Planning with fewer garbage collections: what exists when planning starts (the
    model, torch's modules) is frozen out of the collector's scans (``gc.freeze``) and the
    youngest generation is collected every ``GC_YOUNG_THRESHOLD`` allocations. Planning
    builds millions of small objects (strategies, layouts, cost tables) that live until
    the plan is made; the collector's full scans of them were a fifth of the CPU time of
    planning LLaMA-3-8B. Nothing is decided by when objects are collected, so plans do not
    change; the frozen objects go back to the collector when the outermost call ends."""
    global _planning
    if _planning or not gc.isenabled():
        yield
        return
    _planning += 1
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(threshold[0], GC_YOUNG_THRESHOLD), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
        _planning -= 1


def default_cluster(num_devices: int, *, measure: bool = False) -> Cluster:
    """The hardware torchalpa assumes when none is given: what this job runs on.

    On GPUs ``Cluster.detect()`` (this GPU's model, memory and rates; torchrun's node
    layout when it covers ``num_devices``, else one node), with the rates ``torchalpa
    calibrate`` measured on this device in place of the datasheet's when it has run. On
    CPUs ``local_cpu``'s fixed figures in torchrun's node layout, unless ``measure`` is
    set and a gloo process group of ``num_devices`` > 1 ranks is up: then
    ``measure_cluster()`` (flop/s, op cost and all-reduce latency and bandwidth timed on
    the live group, cached per machine; ``TORCHALPA_CALIBRATE=0`` turns it off).
    ``measure`` is collective, so only ``auto_parallel`` (where every rank gets here) sets
    it; planning without ranks stays deterministic.
    """
    nodes, per_node = _launch_nodes(num_devices)
    if not cuda_selected():
        import torch.distributed as dist
        cluster = Cluster.local_cpu(num_devices)
        if measure and num_devices > 1 and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() == num_devices and dist.get_backend() == "gloo":
            if calibration_enabled():
                cluster = measure_cluster()
        # processes of several launchers: their nodes bound the mesh (within a machine,
        # loopback is as fast across launchers as within one: the rates stay)
        return replace(cluster, num_nodes=nodes, devices_per_node=per_node)
    return calibrated(Cluster.detect(nodes, per_node))


def _launch_nodes(num_devices: int) -> tuple[int, int]:
    """(nodes, devices per node) of this job: torchrun's ``LOCAL_WORLD_SIZE`` ranks per
    launcher when its ``WORLD_SIZE`` is ``num_devices``, else one node."""
    import os
    world = int(os.environ.get("WORLD_SIZE", 0))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    if world == num_devices and local and world % local == 0:
        return world // local, local
    return 1, num_devices


def calibrated(cluster: Cluster) -> Cluster:
    """``cluster`` with the rates ``torchalpa calibrate`` stored for its device, if any
    (``device_profile.apply_profile``), TF32 as this process allows it."""
    profile = load_profile(cluster.device_name, torch.__version__)
    if profile is None:
        return cluster
    return apply_profile(cluster, profile,
                         allow_tf32=torch.get_float32_matmul_precision() != "highest")



def capture_step(model, example_inputs, loss_fn, **options):
    """``capture`` with a progress line: ops, parameters, seconds.

    Captures are not cached on disk: a key that is safe to reuse would have to cover the
    model's code and everything it reads (config objects, globals, closures, the torch
    version), which only tracing sees; and the captured fx graph with its fake-tensor
    metadata does not serialize cheaply. Planning is what the cache saves.
    """
    from torchalpa.core.progress import step
    from torchalpa.frontends.torch_export import capture
    with step("capturing the training step") as progress:
        captured = capture(model, example_inputs, loss_fn, **options)
        graph = captured.graph
        _record_reduce_dtype(model, graph)
        numel = sum(graph.node(n).output.numel for n in graph.params.values())
        progress.done = (f"{sum(1 for _ in graph.ops())} ops, {len(graph.params)} parameters "
                         f"({format_count(numel)} elements)")
    return captured


def _record_reduce_dtype(model, graph) -> None:
    """``MixedPrecision(reduce_dtype=param_dtype)``: the planner must sum gradients in it."""
    from torchalpa.runtime.execution.precision import CastForward
    if isinstance(model, CastForward) and model.policy.narrow_reduction:
        graph.meta["reduce_dtype"] = model.policy.narrow_reduction


def capture_variants(model, example_inputs, loss_fn, option, **options) -> dict:
    """Captures of the step, one per activation-checkpointing mode ``option.remat`` plans
    (``passes/sharding/remat_choice.py``); the checkpointed one is derived without tracing again."""
    from torchalpa.frontends.block_remat import checkpointed_capture
    from torchalpa.passes.sharding.remat_choice import capture_modes
    modes = capture_modes(option.remat)
    plain = capture_step(model, example_inputs, loss_fn, **options,
                         rematerialize_parameters=option.rematerialize_parameters)
    # ZeRO-1/2: the recompute reads the weights' casts forward made (gathered once a step)
    hold = option.parameters == "sharded" and not option.rematerialize_parameters
    return {m: plain if m == "none" else
            checkpointed_capture(plain, m, keep_parameter_values=hold) for m in modes}


def micro_batch_examples(example_inputs: Sequence[torch.Tensor], num_micro_batches: int
                         ) -> tuple:
    """The example inputs of one micro-batch: dim 0 of each divided by ``num_micro_batches``
    (the step is planned for one micro-batch)."""
    from torchalpa.runtime.execution.step import split_micro_batches
    example_inputs = tuple(example_inputs)
    if num_micro_batches == 1:
        return example_inputs
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"example_inputs[{i}] must be a tensor, got {type(x).__name__}")
    return tuple(split_micro_batches(example_inputs, num_micro_batches,
                                     what="example_inputs")[0])


def capture_examples(model: torch.nn.Module, example_inputs, num_micro_batches: int) -> tuple:
    """One micro-batch of example inputs, on ``meta`` if the model is (it lends shapes only)."""
    examples = micro_batch_examples(example_inputs, num_micro_batches)
    on_meta = any(t.device.type == "meta" for t in
                  list(model.parameters()) + list(model.buffers()))
    if on_meta:
        examples = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in examples)
    return examples


def with_precision(model: torch.nn.Module, mixed_precision):
    """What to capture: the model, or the model computing in a narrower dtype."""
    if mixed_precision is None:
        return model
    from torchalpa.runtime.execution.precision import CastForward
    return CastForward(model, mixed_precision)


def with_precision_recorded(plan: AnyPlan, mixed_precision) -> AnyPlan:
    """``plan`` with the mixed precision it was made for in its method record
    (``plan.method["mixed_precision"]``: the compute dtype, e.g. ``"bfloat16"``), so a
    summary and a reader of the JSON see what the estimates assume."""
    if mixed_precision is None:
        return plan
    dtype = str(mixed_precision.param_dtype).removeprefix("torch.")
    return replace(plan, method={**plan.method, "mixed_precision": dtype})


def same_step_on_every_rank(fingerprint: str) -> None:
    """Raise unless every rank captured the step rank 0 did (same model and shapes)."""
    from torchalpa.runtime.execution.mesh import gather_objects
    everyone = gather_objects(fingerprint)
    differ = [r for r, f in enumerate(everyone) if f != everyone[0]]
    if differ:
        raise RuntimeError(
            f"ranks {differ} captured a different training step than rank 0 (a different "
            "model, or example inputs of other shapes or dtypes); every rank must build the "
            "same model and pass example inputs of the same shapes")


def plan_on_rank0(solve: Callable[[], AnyPlan]) -> AnyPlan:
    """Rank 0 solves; every rank gets its plan (of the kind ``solve`` makes), or its error
    (never a hang)."""
    from torchalpa.core.plan import load_plan
    from torchalpa.runtime.execution.mesh import on_rank0
    return cast(AnyPlan, load_plan(on_rank0(lambda: solve().to_json(indent=None), "planning")))
