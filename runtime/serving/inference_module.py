"""InferenceModule: a causal LM parallelized for generation (``mode="inference"``).

What ``torchalpa.auto_parallel(model, example, mode="inference")`` returns. The model's
parameters and buffers are DTensors in the decode plan's layouts (swapped in place, as a
``ParallelModule``'s are), and the static KV cache is held as this rank's blocks in its
planned layouts (for example split by heads); no rank ever holds the whole model or the
whole cache. Two kinds of forward-only program run on them, lowered from their plans by
the same lowering as training (``runtime.lowering.lower``):

- the decode step, planned when the module was built: one token per sequence;
- a prefill per prompt length, captured and planned on first use with every weight and
  cache layout pinned to the decode plan's (collective: every rank calls ``generate``
  with the same prompts, as with any global batch).

Each returns the logits of the last token, whole on every rank, then the cache's new
blocks. A program's writes into a cache block it alone reads are done in place
(``write_cache_in_place``), so a step moves no cache it does not touch.
``generate()`` takes HuggingFace's arguments (``runtime.serving.sampling``) and runs the loop of
``runtime.serving.generate_loop``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchalpa.core.plan import Plan
from torchalpa.runtime.execution.mesh import gather_objects
from torchalpa.runtime.resilience.faults import batch_digest, check_same_inputs
from torchalpa.runtime.serving.generate_loop import generate_tokens, prepare_batch
from torchalpa.runtime.serving.sampling import resolve_sampling

__all__ = ["StepProgram", "InferenceModule", "write_cache_in_place", "GenerationStats"]

aten = torch.ops.aten


@dataclass
class StepProgram:
    """A lowered step of generation: ``program(*state blocks, input_ids, positions,
    valid, start) -> (logits (B, V), *new blocks of the caches in cache_updates)``."""

    program: Callable[..., Any]
    plan: Plan
    state_names: list[str]
    """The model's parameters and buffers, then the cache's, in placeholder order."""
    cache_updates: list[str]
    code: str = ""


def write_cache_in_place(gm: fx.GraphModule, cache_placeholders: Sequence[int]) -> int:
    """Make the cache writes of a lowered step in-place: a cache block whose only reader
    is an ``index_put`` (its new tokens written in) is updated where it lies instead of
    copied, and the step returns the same tensor. Returns how many were rewritten."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    done = 0
    for i in cache_placeholders:
        users = list(placeholders[i].users)
        if len(users) == 1 and users[0].target is aten.index_put.default \
                and users[0].args[0] is placeholders[i]:
            users[0].target = aten.index_put_.default
            done += 1
    if done:
        gm.recompile()
    return done


@dataclass
class GenerationStats:
    """The last ``generate`` call: prefill and per-token decode times (seconds)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    batch: int = 0
    prefill_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)

    @property
    def token_latency_s(self) -> float:
        """Mean seconds of one decode step (a token for every sequence)."""
        return sum(self.decode_s) / len(self.decode_s) if self.decode_s else float("nan")

    def __str__(self) -> str:
        return (f"{self.batch} x ({self.prompt_tokens} prompt + {self.new_tokens} new) "
                f"tokens: prefill {self.prefill_s * 1e3:.3g} ms, "
                f"{self.token_latency_s * 1e3:.3g} ms/token")


class InferenceModule(nn.Module):
    """A causal LM parallelized for generation: ``pm.generate(input_ids, ...)``.

    ``module``: the user's model, its parameters swapped for DTensors; ``plan``: the
    decode step's (``plan.mode == "inference"``); ``mesh``: this rank's DeviceMesh;
    ``batch_size`` x ``max_context``: the planned cache."""

    def __init__(self, module: nn.Module, plan: Plan, mesh, *, decode: StepProgram,
                 make_prefill: Callable[[int], StepProgram], cache: dict[str, DTensor],
                 batch_size: int, max_context: int, device: torch.device,
                 check_inputs: str = "first"):
        super().__init__()
        self.module = module
        self.plan = plan
        self.mesh = mesh
        self.batch_size, self.max_context = batch_size, max_context
        self._device = device
        self._decode = decode
        self._make_prefill = make_prefill
        self._prefills: dict[int, StepProgram] = {}
        self._cache_specs = {n: (t.shape, t.stride(), t.placements) for n, t in cache.items()}
        self._cache = {n: t.to_local() for n, t in cache.items()}
        self._check_values = check_inputs
        self._checked = False
        self._slots: dict[str, tuple[dict, str]] = {}
        self.last_stats = GenerationStats()

    # -- generation ---------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *,
                 generator: torch.Generator | None = None, **kwargs) -> torch.Tensor:
        """Continue each prompt of ``input_ids`` (rows, T) as HuggingFace's
        ``model.generate`` does: ``max_new_tokens`` (or ``max_length``), greedy or
        ``do_sample=True`` with ``temperature``, ``top_k``, ``top_p``; ``eos_token_id`` /
        ``pad_token_id``; ``attention_mask`` for a left-padded batch. Unset values come
        from the model's ``generation_config`` (HuggingFace models), then HuggingFace's
        defaults. Returns ``(rows, T + new tokens)``, the same on every rank.

        Every rank calls it with the same prompts. Sampling draws from ``generator``, or
        from the default CPU generator, which is first made equal on every rank (rank
        0's): ``torch.manual_seed(s)`` before the call gives the same tokens on any
        number of ranks. A batch larger than the planned one, or a prompt plus new
        tokens longer than the cache, is a ValueError naming the limit."""
        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        if input_ids is None:
            raise ValueError("generate needs input_ids (the prompts' token ids)")
        config = getattr(self.module, "generation_config", None)
        sampling = resolve_sampling(kwargs, config, int(input_ids.shape[-1]))
        batch = prepare_batch(input_ids, attention_mask, batch_size=self.batch_size,
                              max_context=self.max_context,
                              max_new_tokens=sampling.max_new_tokens)
        self._check_same_prompts(batch.ids, batch.valid)
        if sampling.do_sample and generator is None:
            from torchalpa.runtime.lowering.random_draws import sync_random_state
            sync_random_state(self._device)
        stats = GenerationStats(prompt_tokens=batch.ids.shape[1], batch=batch.rows)
        T = batch.ids.shape[1]

        def prefill(ids, positions, valid, start):
            began = time.perf_counter()
            logits = self._run(self._prefill(T), ids, positions, valid, start)
            stats.prefill_s = time.perf_counter() - began
            return logits

        def decode(ids, positions, valid, start):
            began = time.perf_counter()
            logits = self._run(self._decode, ids, positions, valid, start)
            stats.decode_s.append(time.perf_counter() - began)
            return logits

        out = generate_tokens(prefill, decode, batch, sampling, generator)
        stats.new_tokens = out.shape[1] - T
        self.last_stats = stats
        return out

    def _prefill(self, length: int) -> StepProgram:
        found = self._prefills.get(length)
        if found is None:
            found = self._prefills[length] = self._make_prefill(length)
        return found

    def _run(self, step: StepProgram, ids, positions, valid, start: int) -> torch.Tensor:
        """One program call; the cache's new blocks replace the old (the same tensors
        when written in place). Returns the logits, synchronized with the device (the
        next token is chosen from them on the host)."""
        device = self._device
        inputs = (ids.to(device), positions.to(device), valid.to(device),
                  torch.tensor(start, dtype=torch.int64, device=device))
        outs = step.program(*self._blocks(step.state_names), *inputs)
        for name, block in zip(step.cache_updates, outs[1:1 + len(step.cache_updates)]):
            self._cache[name] = block
        return outs[0].to("cpu")

    def _check_same_prompts(self, ids: torch.Tensor, valid: torch.Tensor) -> None:
        """Every rank must pass the same prompts (their shapes on every call, their values
        on the first call, or every call with ``check_inputs="always"``): a rank that
        generated from other prompts would take part in collectives of other steps."""
        specs = [(tuple(ids.shape), ids.dtype), (tuple(valid.shape), valid.dtype)]
        check_same_inputs(specs, "prompts")
        if self._check_values == "always" or (self._check_values == "first" and not self._checked):
            everyone = gather_objects(batch_digest([ids, valid]))
            differ = [r for r, d in enumerate(everyone) if d != everyone[0]]
            if differ:
                raise ValueError(f"rank(s) {', '.join(map(str, differ))} passed other prompts "
                                 "(or attention masks) than rank 0: every rank generates "
                                 "together and must pass the same ones (seed them alike)")
        self._checked = True

    def _blocks(self, names: Sequence[str]) -> list[torch.Tensor]:
        """This rank's block of each named tensor: the cache's, or the model's parameter
        or buffer (its owner found once, the entry read each call: a ``.to()`` or a
        checkpoint load may have swapped it)."""
        out = []
        for name in names:
            if name in self._cache:
                out.append(self._cache[name])
                continue
            slot = self._slots.get(name)
            value = None if slot is None else slot[0].get(slot[1])
            if value is None:
                path, _, attr = name.rpartition(".")
                owner = self.module.get_submodule(path)
                entries = owner._parameters if attr in owner._parameters else owner._buffers
                self._slots[name] = (entries, attr)
                value = entries[attr]
            out.append(value._local_tensor if isinstance(value, DTensor) else value)
        return out

    # -- inspection ---------------------------------------------------------------------
    def kv_cache(self) -> dict[str, DTensor]:
        """The cache as DTensors over this rank's blocks (keys and values per layer)."""
        out = {}
        for name, local in self._cache.items():
            shape, stride, placements = self._cache_specs[name]
            out[name] = DTensor.from_local(local, self.mesh, placements, run_check=False,
                                           shape=shape, stride=stride)
        return out

    def cache_bytes(self) -> int:
        """Bytes of the cache blocks this rank holds."""
        return sum(t.numel() * t.element_size() for t in self._cache.values())

    def prefill_plans(self) -> dict[int, Plan]:
        """The prefill plans made so far, by prompt length."""
        return {length: p.plan for length, p in self._prefills.items()}

    def local_program(self) -> str:
        """This rank's decode step as Python code."""
        return self._decode.code

    def unwrap(self) -> nn.Module:
        """A plain copy of the model with full, gathered tensors (every rank must call it):
        for ``generate()`` on one device, ``torch.save`` or comparison."""
        from torchalpa.runtime.state.pretrained_save import gathered_module
        return gathered_module(self)

    def forward(self, *args, **kwargs):
        raise TypeError("a model built with mode='inference' generates: call "
                        "pm.generate(input_ids, ...); for a forward pass on one device, "
                        "pm.unwrap()")

    def extra_repr(self) -> str:
        blocks = ", ".join(f"{n}: {tuple(t.shape)}" for n, t in list(self._cache.items())[:1])
        return (f"mesh={tuple(self.plan.mesh_shape)}, batch_size={self.batch_size}, "
                f"max_context={self.max_context}, cache blocks {blocks}...")

