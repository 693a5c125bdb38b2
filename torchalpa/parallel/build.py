"""The one path from a model to a plan, or to a parallel module, for every method.

``plan_model`` (no processes) and ``build_module`` (under torchrun) take the same steps
whatever the method; what differs -- which meshes are candidates, how a captured step is
solved, how a plan becomes this rank's program -- is asked of the method's
``MethodSteps`` (``torchalpa.parallel.steps``; the tables are
``torchalpa.parallel.methods``). ``AutoParallel`` is resolved first: its search gives a
plan of a concrete method, whose steps the rest takes:

    options -> capture (each checkpointing variant, one micro-batch) -> same step on every
    rank -> plan on rank 0 (or check the plan given) -> place (this rank's mesh, program,
    state) -> compile -> one random state -> ParallelModule

``mode="inference"`` (``plan_generation`` / ``build_generation``) takes the same steps for
generation's forward-only programs (``torchalpa.parallel.generation``):

    options -> the model with its static KV cache -> capture the decode step -> same step
    on every rank -> plan on rank 0 (or check the plan given) -> capture and plan the
    prefill of the example prompt, the decode layouts pinned -> place (mesh, lowering) ->
    distribute the weights, allocate this rank's cache blocks -> InferenceModule
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from torchalpa.core.options import method_of_plan
from torchalpa.core.plan import Plan
from torchalpa.core.plan_check import check_step_dtypes
from torchalpa.parallel.methods import (
    generation_steps_of,
    program_steps_of,
    resolver_of,
    steps_of,
)
from torchalpa.parallel.steps import Placed
from torchalpa.parallel.workflow import (
    capture_examples,
    capture_step,
    capture_variants,
    plan_on_rank0,
    same_step_on_every_rank,
    with_precision,
    with_precision_recorded,
)

__all__ = ["plan_model", "build_module", "plan_generation", "build_generation"]

log = logging.getLogger("torchalpa")


def plan_model(model, example_inputs, loss_fn, *, method, cluster,
               inputs: str, mixed_precision=None, param_argnums=0,
               num_params: int | None = None):
    """``torchalpa.plan`` for ``method``: a torch model's step (each activation-
    checkpointing variant its ``remat`` asks for, computing in ``mixed_precision`` as
    ``auto_parallel`` would run it) planned without processes, or a JAX function /
    StableHLO program where the method plans those."""
    from torchalpa.interop.programs import is_program
    if is_program(model):
        if loss_fn is not None:
            raise ValueError(f"model is a {type(model).__name__}, not an nn.Module, so it is "
                             "read as a JAX function or StableHLO program, which carries its "
                             "own loss: pass no loss_fn, or give a torch nn.Module")
        if mixed_precision is not None:
            raise ValueError("mixed_precision= applies to torch models; a JAX function or "
                             "StableHLO program computes in the dtypes it is written in")
        concrete, program_steps = program_steps_of(method)
        return program_steps.plan_program(model, example_inputs, method=concrete,
                                          cluster=cluster, inputs=inputs,
                                          param_argnums=param_argnums, num_params=num_params)
    from torchalpa.passes.sharding.remat_choice import plan_with_remat
    from torchalpa.runtime.execution.mesh import world_size
    resolver = resolver_of(method)
    if resolver is not None:
        method = resolver.with_options(method, inputs=inputs)
        target = resolver.target(method, cluster=cluster, mesh=None, world=world_size(),
                                 live=False)
        return with_precision_recorded(resolver.search(
            with_precision(model, mixed_precision), example_inputs, loss_fn, method=method,
            target=target, inputs=inputs), mixed_precision)
    steps = steps_of(method)
    method = steps.with_options(method, inputs=inputs)
    target = steps.target(method, cluster=cluster, mesh=None, world=world_size(),
                          live=False)
    examples = capture_examples(model, example_inputs, method.num_micro_batches)
    variants = capture_variants(with_precision(model, mixed_precision), examples, loss_fn,
                                method.auto_sharding_option)
    check_step_dtypes(next(iter(variants.values())).graph)
    return with_precision_recorded(plan_with_remat(
        variants, lambda c: steps.solve(c.graph, target, method, inputs), lambda c: c.graph),
        mixed_precision)


def chosen_capture(searched: dict, traced, examples, loss_fn, option, num_micro_batches: int,
                   signature):
    """The capture of the method AutoParallel chose: the search's own on rank 0 (no second
    trace), else captured plain and derived as the search derives it (the same step, so
    every rank's fingerprint matches rank 0's)."""
    from torchalpa.parallel.auto import derived_capture
    key = (num_micro_batches, option.remat, bool(option.rematerialize_parameters))
    if key in searched:
        return searched[key]
    plain = capture_step(traced, examples, loss_fn, signature=signature)
    return derived_capture(plain, option.remat, bool(option.rematerialize_parameters))


def priced_as_compiled(method, compile):
    """``method`` planned as ``compile=`` runs it: under ``torch.compile`` the step's
    elementwise chains run as fused kernels, a few the host issues in place of one per ATen
    op, so a compiled step is priced with ``AutoShardingOption(elementwise="fused")``
    (fused chains' memory traffic, no per-op host issue cost: ``LogicalMesh.eager_kernels``)."""
    option = getattr(method, "auto_sharding_option", None)
    if not compile or option is None or option.elementwise == "fused":
        return method
    return replace(method, auto_sharding_option=replace(option, elementwise="fused"))


def build_module(model, example_inputs, loss_fn, *, method, signature,
                 mesh, cluster, inputs, optimizer, plan, num_micro_batches, mixed_precision,
                 init_weights, compile, check_replicas, check_inputs):
    """``torchalpa.auto_parallel`` for ``method`` (the options checked there): rank 0
    plans, every rank lowers its own program and takes its share of the model's state."""
    from torchalpa.passes.sharding.remat_choice import chosen_remat, plan_with_remat
    from torchalpa.runtime.execution import mesh as mesh_mod
    from torchalpa.runtime.execution.module import ParallelModule
    from torchalpa.runtime.execution.step import StepRunner
    from torchalpa.runtime.lowering.random_draws import sync_random_state

    options = dict(signature=signature, mesh=mesh, inputs=inputs, init_weights=init_weights)
    resolver = resolver_of(method := priced_as_compiled(method, compile))  # before any group
    if resolver is not None:
        auto = resolver.with_options(method, num_micro_batches=num_micro_batches, **options)
    else:
        steps = steps_of(method)
        method = steps.with_options(method, num_micro_batches=num_micro_batches, **options)
    mesh_mod.init_distributed()
    world = mesh_mod.world_size()
    start = time.perf_counter()
    traced = with_precision(model, mixed_precision)
    searched: dict = {}            # rank 0's search's captures: the chosen one is reused
    if resolver is not None:       # rank 0 searches; every rank goes on with its choice
        searched_target = resolver.target(auto, cluster=cluster, mesh=mesh, world=world,
                                          live=True)
        if plan is None:
            plan = plan_on_rank0(lambda: with_precision_recorded(resolver.search(
                traced, example_inputs, loss_fn, method=auto, target=searched_target,
                inputs=inputs, signature=signature, captures=searched),
                mixed_precision))
        else:
            resolver.check_plan_kind(plan)
        steps = steps_of(method_of_plan(plan))
        method = steps.with_options(method_of_plan(plan), **options)
        cluster = searched_target.cluster
    target = steps.target(method, cluster=cluster, mesh=mesh, world=world, live=True)
    option = method.auto_sharding_option
    if plan is not None:         # capture what the plan was made for
        steps.check_plan_kind(plan)
        option = replace(option, remat=chosen_remat(plan))
    examples = capture_examples(model, example_inputs, method.num_micro_batches)
    if resolver is not None:   # one capture per auto_parallel: the search's, derived alike
        variants = {option.remat: chosen_capture(searched, traced, examples, loss_fn, option,
                                                 method.num_micro_batches, signature)}
    else:
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


def plan_generation(model, example_inputs, *, method, cluster, option):
    """``torchalpa.plan(..., mode="inference")``: the decode step planned, the example
    prompt's prefill planned on its layouts, without processes."""
    from torchalpa.parallel.generation import (
        cached_step,
        capture_generation_step,
        prompt_shape,
        serving_plan,
    )
    from torchalpa.runtime.execution.mesh import world_size
    method, steps = generation_steps_of(method)    # AutoParallel: its intra-op method
    target = steps.target(method, cluster=cluster, mesh=None, world=world_size(), live=False)
    step = cached_step(model, example_inputs, option)
    _, length = prompt_shape(example_inputs)
    decode = capture_generation_step(step, 1)
    decode_plan = steps.solve(decode.graph, target, method, "global")
    prefill = capture_generation_step(step, length)
    prefill_plan = steps.solve_pinned(prefill.graph, decode_plan, target, method, "global")
    return serving_plan(decode_plan, prefill_plan, decode.graph, step, length)


def _given_inference_plan(steps, plan, graph, target):
    """A ``plan=`` for generation, checked: made with mode='inference', for this step."""
    steps.check_plan_kind(plan)
    if getattr(plan, "mode", "training") != "inference":
        raise ValueError("the plan given was made for training; mode='inference' needs a "
                         "plan made with mode='inference' (or none)")
    steps.check_given_plan(plan, graph, target)
    return plan


def build_generation(model, example_inputs, *, method, option, mesh,
                     cluster, plan, init_weights, check_inputs):
    """``torchalpa.auto_parallel(..., mode="inference")`` (the options checked there):
    rank 0 plans the decode step, every rank lowers it and takes its share of the weights
    and of the cache; prefills are planned on first use per prompt length."""
    from torchalpa.parallel.generation import (
        cached_step,
        capture_generation_step,
        model_plan,
        prompt_shape,
        serving_plan,
    )
    from torchalpa.runtime.execution import mesh as mesh_mod
    from torchalpa.runtime.execution.materialize import (
        distribute_module_state,
        local_zeros,
        to_dtensor_placements,
    )
    from torchalpa.runtime.serving.inference_module import (
        InferenceModule,
        StepProgram,
        write_cache_in_place,
    )

    method, steps = generation_steps_of(method)    # AutoParallel: its intra-op method
    method = steps.with_options(method, mesh=mesh, init_weights=init_weights)
    mesh_mod.init_distributed()
    target = steps.target(method, cluster=cluster, mesh=mesh, world=mesh_mod.world_size(),
                          live=True)
    start = time.perf_counter()
    step = cached_step(model, example_inputs, option)
    _, length = prompt_shape(example_inputs)
    decode = capture_generation_step(step, 1)
    same_step_on_every_rank(decode.graph.fingerprint())
    decode_plan = _given_inference_plan(steps, plan, decode.graph, target) \
        if plan is not None else \
        plan_on_rank0(lambda: steps.solve(decode.graph, target, method, "global"))
    device = mesh_mod.default_device()
    placed = steps.place_forward(decode_plan, target, method, device)
    state_names = [v.name for v in decode_plan.parameters]
    cache_names = step.cache_names()

    def program(captured, a_plan: Plan) -> StepProgram:
        gm = placed.lower(captured.gm, a_plan, captured.buffer_updates)
        names = captured.state_names
        write_cache_in_place(gm, [i for i, n in enumerate(names) if n in set(cache_names)])
        return StepProgram(gm, a_plan, list(names), list(captured.buffer_updates),
                           code=gm.code)

    def make_prefill(prompt_length: int) -> StepProgram:
        captured = capture_generation_step(step, prompt_length)
        return program(captured, steps.solve_pinned(captured.graph, decode_plan, target,
                                                    method, "global"))

    prefill = make_prefill(length)
    the_plan = plan if plan is not None else \
        serving_plan(decode_plan, prefill.plan, decode.graph, step, length)
    distribute_module_state(model, model_plan(the_plan), placed.mesh, device,
                            init_weights=init_weights)
    buffers = dict(step.named_buffers())
    cache = {v.name: local_zeros(buffers[v.name], placed.mesh,
                                 to_dtensor_placements(v.placements), device)
             for v in the_plan.parameters if v.name in set(cache_names)}
    assert set(cache) == set(cache_names), "the decode plan places every cache buffer"
    prefills = {length: prefill}

    def prefill_of(prompt_length: int) -> StepProgram:
        return prefills.pop(prompt_length, None) or make_prefill(prompt_length)

    log.info("auto_parallel (inference) ready in %.2fs: %d state tensors, cache %s",
             time.perf_counter() - start, len(state_names), tuple(next(iter(cache.values())).shape))
    return InferenceModule(model, the_plan, placed.mesh, decode=program(decode, the_plan),
                           make_prefill=prefill_of, cache=cache,
                           batch_size=step.batch_size, max_context=step.max_context,
                           device=device, check_inputs=check_inputs)
