"""The one path from a model to a plan, or to a parallel module, for every method.

``plan_model`` (no processes) and ``build_module`` (under torchrun) take the same steps
whatever the method; what differs -- which meshes are candidates, how a captured step is
solved, how a plan becomes this rank's program -- is asked of the method's
``MethodSteps`` (``torchalpa.parallel.steps``; the table of them is
``torchalpa.parallel.methods``):

    options -> capture (each checkpointing variant, one micro-batch) -> same step on every
    rank -> plan on rank 0 (or check the plan given) -> place (this rank's mesh, program,
    state) -> compile -> one random state -> ParallelModule
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from torchalpa.core.options import method_of_plan
from torchalpa.core.plan_check import check_step_dtypes
from torchalpa.parallel.methods import steps_of
from torchalpa.parallel.steps import MethodSteps, Placed
from torchalpa.parallel.workflow import (
    capture_examples,
    capture_variants,
    plan_on_rank0,
    same_step_on_every_rank,
    with_precision,
    with_precision_recorded,
)

__all__ = ["plan_model", "build_module"]

log = logging.getLogger("torchalpa")


def plan_model(model, example_inputs, loss_fn, *, method, steps: MethodSteps, cluster,
               inputs: str, mixed_precision=None, param_argnums=0,
               num_params: int | None = None):
    """``torchalpa.plan`` for ``method``: a torch model's step (each activation-
    checkpointing variant its ``remat`` asks for, computing in ``mixed_precision`` as
    ``auto_parallel`` would run it) planned without processes, or a JAX function /
    StableHLO program where the method plans those."""
    from torchalpa.interop.programs import is_program
    if is_program(model):
        if loss_fn is not None:
            raise ValueError("a JAX function or StableHLO program carries its own loss: "
                             "pass no loss_fn")
        if mixed_precision is not None:
            raise ValueError("mixed_precision= applies to torch models; a JAX function or "
                             "StableHLO program computes in the dtypes it is written in")
        return steps.plan_program(model, example_inputs, method=method, cluster=cluster,
                                  inputs=inputs, param_argnums=param_argnums,
                                  num_params=num_params)
    from torchalpa.passes.remat_choice import plan_with_remat
    from torchalpa.runtime.mesh import world_size
    method = steps.with_options(method, inputs=inputs)
    target = steps.target(method, cluster=cluster, mesh=None, world=world_size(),
                          live=False)
    if steps.chooses_method:
        return with_precision_recorded(steps.search(
            with_precision(model, mixed_precision), example_inputs, loss_fn, method=method,
            target=target, inputs=inputs), mixed_precision)
    examples = capture_examples(model, example_inputs, method.num_micro_batches)
    variants = capture_variants(with_precision(model, mixed_precision), examples, loss_fn,
                                method.auto_sharding_option)
    check_step_dtypes(next(iter(variants.values())).graph)
    return with_precision_recorded(plan_with_remat(
        variants, lambda c: steps.solve(c.graph, target, method, inputs), lambda c: c.graph),
        mixed_precision)


def build_module(model, example_inputs, loss_fn, *, method, steps: MethodSteps, signature,
                 mesh, cluster, inputs, optimizer, plan, num_micro_batches, mixed_precision,
                 init_weights, compile, check_replicas, check_inputs):
    """``torchalpa.auto_parallel`` for ``method`` (the options checked there): rank 0
    plans, every rank lowers its own program and takes its share of the model's state."""
    from torchalpa.passes.remat_choice import chosen_remat, plan_with_remat
    from torchalpa.runtime import mesh as mesh_mod
    from torchalpa.runtime.module import ParallelModule
    from torchalpa.runtime.random import sync_random_state
    from torchalpa.runtime.step import StepRunner

    options = dict(signature=signature, mesh=mesh, inputs=inputs, init_weights=init_weights)
    method = steps.with_options(method, num_micro_batches=num_micro_batches, **options)
    mesh_mod.init_distributed()
    world = mesh_mod.world_size()
    target = steps.target(method, cluster=cluster, mesh=mesh, world=world, live=True)
    start = time.perf_counter()
    traced = with_precision(model, mixed_precision)
    if steps.chooses_method:       # rank 0 searches; every rank goes on with its choice
        if plan is None:
            plan = plan_on_rank0(lambda: with_precision_recorded(steps.search(
                traced, example_inputs, loss_fn, method=method, target=target, inputs=inputs,
                signature=signature), mixed_precision))
        method = method_of_plan(plan)
        steps = steps_of(method)
        method = steps.with_options(method, **options)
        target = steps.target(method, cluster=target.cluster, mesh=mesh, world=world,
                              live=True)
    option = method.auto_sharding_option
    if plan is not None:         # capture what the plan was made for
        steps.check_plan_kind(plan)
        option = replace(option, remat=chosen_remat(plan))
    examples = capture_examples(model, example_inputs, method.num_micro_batches)
    variants = capture_variants(traced, examples, loss_fn, option, signature=signature)
    captured = next(iter(variants.values()))
    check_step_dtypes(captured.graph)
    same_step_on_every_rank(captured.graph.fingerprint())
    device = mesh_mod.default_device()
    if plan is not None:
        steps.check_given_plan(plan, captured.graph, target)
        the_plan = plan
    else:
        measured = steps.measure(captured, target, method, example_inputs, model, device)
        the_plan = plan_on_rank0(lambda: with_precision_recorded(plan_with_remat(
            variants, lambda c: steps.solve(c.graph, target, method, inputs, measured),
            lambda c: c.graph), mixed_precision))
        captured = variants[chosen_remat(the_plan)]
    placed: Placed = steps.place(captured, the_plan, target, method, device, model=model,
                                 traced=traced, loss_fn=loss_fn, inputs=inputs,
                                 signature=signature)
    program = placed.program
    if compile:
        program = program.compiled(**(compile if isinstance(compile, dict) else {}))
    placed.distribute(init_weights)
    runner = StepRunner(program, placed.num_micro_batches, **placed.runner_options)
    sync_random_state(device)    # last: planning or initialization may have drawn on rank 0
    log.info("auto_parallel ready in %.2fs: %s", time.perf_counter() - start, placed.description)
    input_specs = [(tuple(x.shape), x.dtype) for x in example_inputs]
    if inputs == "local":
        size = placed.mesh.size()
        input_specs = [(tuple(s // size if i == 0 else s for i, s in enumerate(shape)), dtype)
                       for shape, dtype in input_specs]
    return ParallelModule(model, the_plan, runner, placed.mesh, stage=placed.stage,
                          input_specs=input_specs, inputs=inputs, device=device,
                          optimizer=optimizer, forward_programs=placed.forward_programs,
                          signature=signature, check_replicas=check_replicas,
                          check_inputs=check_inputs)
