"""The pieces ``torchalpa.parallel.build`` assembles for ``mode="inference"``.

A causal LM and its static KV cache become one module (``models/cached_step.py``); its
decode step (one token per sequence) and its prefill (a prompt) are captured as
forward-only steps, with the cache among the state they read and write
(``capture_forward``); the decode step is planned like any step, each prefill with the
decode plan's layouts pinned; the decode plan records the mode, what each device holds
(weights, cache) and what a token costs (``serving_plan``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
import torch.nn as nn

from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import Inference
from torchalpa.core.plan import Plan
from torchalpa.core.plan_records import Estimates
from torchalpa.core.progress import step as progress_step
from torchalpa.core.units import format_bytes
from torchalpa.models.cached_step import CachedStep, decoder_for, is_cache_name
from torchalpa.passes.pricing.inplace_pricing import IN_PLACE

__all__ = ["check_generation_options", "prompt_shape", "cached_step", "capture_generation_step",
           "serving_plan", "model_plan", "local_bytes"]

log = logging.getLogger("torchalpa")


def check_generation_options(*, loss_fn, inputs: str, **given) -> None:
    """``auto_parallel`` / ``plan`` options that mean nothing for generation are a
    ValueError naming them (``given``: option name -> value, None or False when unset)."""
    if loss_fn is not None:
        raise ValueError("mode='inference' plans generation, which has no loss: pass no "
                         "loss_fn (example_inputs are the prompts' token ids)")
    if inputs != "global":
        raise ValueError("mode='inference' takes the same prompts on every rank: "
                         "inputs must be 'global'")
    set_ = sorted(name for name, value in given.items() if value not in (None, False))
    if set_:
        raise ValueError(f"{', '.join(set_)} do(es) not apply with mode='inference' (no "
                         "backward, no optimizer step); for a narrower dtype, cast the model "
                         "itself (model.to(torch.bfloat16))")


def prompt_shape(example_inputs) -> tuple[int, int]:
    """(batch, prompt length) of the example prompts: a (B, T) tensor of token ids, a
    tuple starting with one, or a dict with ``input_ids``."""
    ids = example_inputs
    if isinstance(ids, Mapping):
        if "input_ids" not in ids:
            raise ValueError("mode='inference' example_inputs as a dict need 'input_ids'")
        ids = ids["input_ids"]
    elif isinstance(ids, Sequence) and not isinstance(ids, torch.Tensor):
        if not ids:
            raise ValueError("example_inputs is empty: give the prompts' token ids (B, T)")
        ids = ids[0]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        what = f"a {tuple(ids.shape)} tensor" if isinstance(ids, torch.Tensor) \
            else type(ids).__name__
        raise ValueError(f"mode='inference' needs example prompts of token ids shaped "
                         f"(batch, prompt length), got {what}")
    return int(ids.shape[0]), int(ids.shape[1])


def cached_step(model: nn.Module, example_inputs, option: Inference) -> CachedStep:
    """``model`` (put in eval mode: generation runs no dropout) with a cache of the
    example's batch and ``option.max_context`` slots, built on ``meta``."""
    batch, length = prompt_shape(example_inputs)
    decoder = decoder_for(model)
    context = option.max_context or decoder.layout.max_positions
    if length >= context:
        raise ValueError(f"the example prompt has {length} tokens, which leaves no room to "
                         f"generate in a cache of {context} slots (max_context); shorten it or "
                         f"raise max_context up to the model's {decoder.layout.max_positions} "
                         "positions")
    model.eval()
    return CachedStep(model, batch, context, device="meta", decoder=decoder)


def step_examples(step: CachedStep, length: int) -> tuple[torch.Tensor, ...]:
    """Meta stand-ins for one call: ids and positions (B, length), valid (B, S), start."""
    B, S = step.batch_size, step.max_context
    return (torch.empty(B, length, dtype=torch.int64, device="meta"),
            torch.empty(B, length, dtype=torch.int64, device="meta"),
            torch.empty(B, S, dtype=torch.bool, device="meta"),
            torch.empty((), dtype=torch.int64, device="meta"))


def capture_generation_step(step: CachedStep, length: int):
    """The step over ``length`` new tokens (1: decode; the prompt's: prefill) captured
    forward-only, its cache writes among its outputs."""
    from torchalpa.frontends.torch_export import capture_forward
    what = "decode step" if length == 1 else f"prefill of {length} tokens"
    with progress_step(f"capturing the {what}") as progress:
        captured = capture_forward(step, step_examples(step, length), outputs=True)
        progress.done = f"{sum(1 for _ in captured.graph.ops())} ops"
    written = set(captured.buffer_updates)
    unwritten = [n for n in step.cache_names() if n not in written]
    if unwritten:
        raise RuntimeError(f"the captured {what} does not write the cache buffers "
                           f"{unwritten[:4]}: the model did not use the static cache it was "
                           "given (torchalpa/models/cached_step.py)")
    # the runtime writes the cache where it lies (runtime.serving.inference_module.write_cache_in_place)
    captured.graph.meta[IN_PLACE] = tuple(step.cache_names())
    return captured


def local_bytes(graph: OpGraph, plan: Plan, names) -> float:
    """Bytes one device holds of the state ``names`` (each whole size divided by the mesh
    axes that split it)."""
    wanted = set(names)
    total = 0.0
    for value in plan.parameters:
        if value.name not in wanted:
            continue
        nbytes = graph.node(value.node).outputs[0].nbytes
        for axis, p in enumerate(value.placements):
            if p.is_shard():
                nbytes /= plan.mesh_shape[axis]
        total += nbytes
    return total


def serving_plan(decode: Plan, prefill: Plan, graph: OpGraph, step: CachedStep,
                 prompt_length: int) -> Plan:
    """The decode plan as generation's plan: ``mode="inference"``, what each device holds
    and what one token costs (``Estimates``), and a note saying so."""
    names = [v.name for v in decode.parameters]
    cache = local_bytes(graph, decode, [n for n in names if is_cache_name(n)])
    weights = local_bytes(graph, decode, [n for n in names if not is_cache_name(n)])
    latency = decode.estimates["step_time_s"]
    estimates = Estimates.from_dict(dict(
        decode.estimates, weight_bytes_per_device=weights, kv_cache_bytes_per_device=cache,
        token_latency_s=latency, tokens_per_s=step.batch_size / latency,
        prefill_time_s=prefill.estimates.get("step_time_s")))
    note = (f"generation: a cache of {step.batch_size} sequences x {step.max_context} tokens; "
            f"per device {format_bytes(weights)} of weights + {format_bytes(cache)} of cache; "
            f"est {latency * 1e3:.3g} ms per token ({step.batch_size / latency:.4g} tokens/s), "
            f"prefill of {prompt_length} tokens "
            f"{prefill.estimates.get('step_time_s', float('nan')) * 1e3:.3g} ms")
    log.info(note)
    return replace(decode, mode="inference", estimates=estimates, notes=decode.notes + (note,))


def model_plan(plan: Plan) -> Plan:
    """``plan`` without the cache: the model's own state, which the model is given."""
    return replace(plan, parameters=tuple(v for v in plan.parameters
                                          if not is_cache_name(v.name)))
