"""The two entry points: ``plan`` (no processes) and ``auto_parallel`` (under torchrun).

Both check what any method is given, then take the one path every method takes
(``torchalpa.parallel.build``) with the method's steps from the table
(``torchalpa.parallel.methods``: ``ShardParallel`` and its presets in ``shard.py``,
``PipeshardParallel`` in ``pipeshard.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, overload

import torch

from torchalpa.core.calls import CallSignature
from torchalpa.core.cluster import Cluster, LogicalMesh
from torchalpa.core.options import (
    AutoParallel,
    Inference,
    PipeshardParallel,
    ShardParallel,
    parse_mode,
)
from torchalpa.core.plan import PipelinePlan, Plan
from torchalpa.core.progress import setup_logging
from torchalpa.core.progress import verbose as solver_log
from torchalpa.parallel.build import build_generation, build_module, plan_generation, plan_model
from torchalpa.parallel.methods import check_method
from torchalpa.parallel.tp_pins import resolve_style_pins
from torchalpa.parallel.workflow import planning_gc

if TYPE_CHECKING:
    from torchalpa.runtime.execution.module import ParallelModule
    from torchalpa.runtime.serving.inference_module import InferenceModule

__all__ = ["plan", "auto_parallel"]

Method = AutoParallel | ShardParallel | PipeshardParallel
_INPUT_MODES = ("global", "local")
_CHECK_INPUTS = ("first", "always", "never")


def _check_method(method) -> Method:
    if method is None or method == "auto":
        method = AutoParallel()
    check_method(method)     # a TypeError naming the methods for anything else
    return method


def _check_inputs_mode(inputs: str) -> None:
    if inputs not in _INPUT_MODES:
        raise ValueError(f"inputs must be one of {_INPUT_MODES}, got {inputs!r}")


def plan(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor],
         loss_fn: Callable | None = None, *, method: Method | None = None,
         cluster: Cluster | LogicalMesh | None = None, inputs: str = "global",
         mixed_precision=None, verbose: bool = False, param_argnums=0,
         num_params: int | None = None,
         mode: str | Inference = "training") -> Plan | PipelinePlan:
    """Plan ``model`` for ``cluster`` without running it: no process group, no real weights.

    ``model`` and ``example_inputs`` may live on the ``meta`` device. Without a cluster the
    plan is for this job's world (one device outside torchrun). A ``LogicalMesh`` instead
    of a Cluster gives the exact per-axis costs to plan with. Unless the method fixes a
    logical mesh shape, every 1D and 2D view of the cluster is tried and the fastest kept.
    ``mixed_precision=torchalpa.MixedPrecision(param_dtype=torch.bfloat16)`` prices the
    step as ``auto_parallel`` runs it with the same option: compute and activations in
    ``param_dtype``, float32 master parameters, gradients and optimizer states (recorded
    as ``plan.method["mixed_precision"]``).
    Progress goes to the ``torchalpa`` logger (``TORCHALPA_LOG=debug|info|warning``);
    ``verbose=True`` also streams the ILP solver's own log.

    ``model`` may also be a JAX function (its loss, differentiated over the arguments at
    ``param_argnums``) or StableHLO text / a ``.mlir`` path (the first ``num_params``
    arguments of ``@main`` are parameters): see ``torchalpa/interop/programs.py``.

    ``mode="inference"`` (or ``torchalpa.Inference(max_context=...)``) plans generation
    instead of training: ``example_inputs`` are prompts of token ids (B, T) for a causal
    LM; the decode step (one token for each of B sequences, with a static KV cache of
    ``max_context`` tokens) is planned, then the prefill of a T-token prompt on its
    layouts. The plan returned is the decode step's (``plan.mode == "inference"``); its
    estimates add the weights and cache each device holds, the time per token, tokens per
    second and the prefill's time.
    """
    setup_logging()
    with solver_log(verbose), planning_gc():
        method = resolve_style_pins(_check_method(method), model)
        _check_inputs_mode(inputs)
        option = parse_mode(mode)
        if option is not None:
            from torchalpa.parallel.generation import check_generation_options
            check_generation_options(loss_fn=loss_fn, inputs=inputs)
            return plan_generation(model, example_inputs, method=method,
                                   cluster=cluster, option=option)
        return plan_model(model, example_inputs, loss_fn, method=method,
                          cluster=cluster, inputs=inputs,
                          mixed_precision=mixed_precision, param_argnums=param_argnums,
                          num_params=num_params)



def _check_call_options(inputs: str, check_inputs: str, num_micro_batches) -> None:
    """ValueError naming the first of ``auto_parallel``'s plain options that is not valid."""
    _check_inputs_mode(inputs)
    if check_inputs not in _CHECK_INPUTS:
        raise ValueError(f"check_inputs must be one of {_CHECK_INPUTS}, got {check_inputs!r}")
    if num_micro_batches is not None and (isinstance(num_micro_batches, bool) or not isinstance(
            num_micro_batches, int) or num_micro_batches < 1):
        raise ValueError(f"num_micro_batches must be an int >= 1, got {num_micro_batches!r}")

@overload
def auto_parallel(model: torch.nn.Module, example_inputs, loss_fn: Callable | None = None, *,
                  method: Method | None = None, mesh=None,
                  cluster: Cluster | LogicalMesh | None = None, inputs: str = "global",
                  optimizer: Callable | None = None, plan: Plan | None = None,
                  num_micro_batches: int | None = None, mixed_precision=None,
                  init_weights: Callable | None = None, compile: bool | dict = False,
                  check_replicas: bool | None = None, check_inputs: str = "first",
                  verbose: bool = False, mode: Literal["training"] = "training"
                  ) -> ParallelModule: ...


@overload
def auto_parallel(model: torch.nn.Module, example_inputs, loss_fn: Callable | None = None, *,
                  method: Method | None = None, mesh=None,
                  cluster: Cluster | LogicalMesh | None = None, inputs: str = "global",
                  optimizer: Callable | None = None, plan: Plan | None = None,
                  num_micro_batches: int | None = None, mixed_precision=None,
                  init_weights: Callable | None = None, compile: bool | dict = False,
                  check_replicas: bool | None = None, check_inputs: str = "first",
                  verbose: bool = False, mode: Literal["inference"] | Inference
                  ) -> InferenceModule: ...


def auto_parallel(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor],
                  loss_fn: Callable | None = None, *, method: Method | None = None,
                  mesh=None, cluster: Cluster | LogicalMesh | None = None,
                  inputs: str = "global", optimizer: Callable | None = None,
                  plan: Plan | None = None, num_micro_batches: int | None = None,
                  mixed_precision=None, init_weights: Callable | None = None,
                  compile: bool | dict = False, check_replicas: bool | None = None,
                  check_inputs: str = "first", verbose: bool = False,
                  mode: str | Inference = "training") -> ParallelModule | InferenceModule:
    """Parallelize ``model``'s training step over every rank of this torchrun job (or, with
    ``mode="inference"``, its generation: see the last item).

    ``example_inputs`` are the model inputs followed by the loss targets (when ``loss_fn``
    is given), or a dict of keyword arguments for ``model(**example_inputs)`` (the loss is
    the model's own, ``outputs["loss"]``, or ``loss_fn(outputs)``; the module is then called
    by keyword too, ``pmodel(input_ids=..., labels=...)``, and returns the forward's output
    type with its ``loss`` set); with ``inputs="global"`` every rank later passes the same global batch of
    that shape, with ``inputs="local"`` its own shard of the batch dim. Rank 0 plans and
    broadcasts the plan, so every rank runs the same one. ``optimizer``, if given, is
    called with the parallel parameters and enables ``train_step``. ``plan`` reuses a plan
    made earlier (``Plan.load``) for this model and mesh instead of solving again.

    - ``num_micro_batches=k``: gradient accumulation. The plan is made for one micro-batch
      (dim 0 of every example input divided by ``k``); a step runs the ``k`` micro-batches
      one after the other, sums their gradients and returns the mean of their losses, so a
      mean-reduced loss gives the whole batch's loss and gradients. With
      ``PipeshardParallel`` the micro-batches flow through the stages: the option sets the
      method's ``num_micro_batches`` (or must equal it).
    - ``mixed_precision=torchalpa.MixedPrecision(param_dtype=torch.bfloat16)``: float32
      parameters (the DTensors the optimizer updates), forward and backward in
      ``param_dtype``, float32 gradients.
    - ``init_weights=fn``: for a model built on the ``meta`` device, only this rank's blocks
      are allocated, then ``fn(module)`` initializes them in place on the DTensors (default:
      ``reset_parameters()`` of every submodule that has one). Given for a real model, it
      re-initializes it.
    - ``compile=True`` (or a dict of ``torch.compile`` options): the local programs run
      under ``torch.compile``, planned so (``AutoShardingOption(elementwise="fused")``).
    - ``PipeshardParallel`` builds its stages' meshes itself and needs the global batch on
      every rank: ``mesh=``, ``inputs="local"`` and ``init_weights=`` raise a ValueError
      saying why (``torchalpa.parallel.pipeshard.pipeline_options``).
    - Random numbers (dropout): every rank continues from rank 0's generator state once the
      model is wrapped (a ``RandomStateWarning`` says when they differed), so replicas draw
      alike and sharded draws are one independent block per device
      (``AutoShardingOption(random="replicated")`` for single-device numerics).
      ``check_replicas=True`` (default: ``TORCHALPA_CHECK_REPLICAS``) checks before every
      step that replicated values and generator states agree on every rank
      (``ReplicaMismatchError`` names the value that differs).
    - ``check_inputs="first"`` (default) | ``"always"`` | ``"never"``: with
      ``inputs="global"``, compare a hash of each rank's batch across ranks on the first
      call, on every call (one small all-gather and a pass over the batch each step), or
      never; ranks given different data (a data-loader bug) raise a ValueError naming them.
    - ``verbose=True``: rank 0 streams the ILP solver's log too (progress lines are shown
      by default; ``TORCHALPA_LOG=warning`` silences them).
    - ``mode="inference"`` (or ``torchalpa.Inference(max_context=...)``): a causal LM (a
      HuggingFace ``*ForCausalLM`` or the zoo's GPT / Llama) for generation only: an
      ``InferenceModule`` whose ``generate(input_ids, ...)`` takes HuggingFace's arguments.
      ``example_inputs`` are prompts (B, T): B is the batch the static KV cache holds.
      Options of training (``loss_fn``, ``optimizer``...) raise a ValueError; a meta model
      is filled by ``init_weights`` or ``torchalpa.load_pretrained``. See ``docs/serving.md``.
    """
    setup_logging()
    with solver_log(verbose), planning_gc():
        method = resolve_style_pins(_check_method(method), model)
        _check_call_options(inputs, check_inputs, num_micro_batches)
        option = parse_mode(mode)
        if option is not None:
            from torchalpa.parallel.generation import check_generation_options
            check_generation_options(loss_fn=loss_fn, inputs=inputs, optimizer=optimizer,
                                     num_micro_batches=num_micro_batches, compile=compile,
                                     mixed_precision=mixed_precision, check_replicas=check_replicas)
            return build_generation(model, example_inputs, method=method, option=option,
                                    mesh=mesh, cluster=cluster, plan=plan,
                                    init_weights=init_weights, check_inputs=check_inputs)
        signature, example_inputs = CallSignature.of(example_inputs)
        return build_module(model, example_inputs, loss_fn, method=method, signature=signature,
                            inputs=inputs, check_inputs=check_inputs, mesh=mesh,
                            num_micro_batches=num_micro_batches, cluster=cluster, plan=plan,
                            optimizer=optimizer, mixed_precision=mixed_precision,
                            init_weights=init_weights, compile=compile,
                            check_replicas=check_replicas)
