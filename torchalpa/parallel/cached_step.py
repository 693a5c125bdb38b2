"""A causal LM and its static KV cache as one module: what generation captures.

``CachedStep(model, batch_size, max_context)`` is called as
``step(input_ids (B, T), positions (B, T), valid (B, S) bool, start () int64)`` and
returns the logits of the last new token, ``(B, vocab)``. It feeds T new tokens through
the model against a KV cache held as its buffers (``kv_cache.{layer}.key`` / ``.value``,
each ``(B, KV heads, S, head dim)``), writing their keys and values into slots
``start .. start + T - 1`` in place. Captured, the in-place writes become the cache's new
values among the step's outputs (``frontends/torch_export.capture_forward``), so the
prefill (T = prompt length, start 0) and the decode step (T = 1) are forward-only
programs of fixed shapes whose cache can be planned and sharded like any state.

The module shows the model's own parameters, buffers and submodules under their own
names (it shares them, it does not own the model as a child), plus ``kv_cache``: plans
name the weights as the model does, and ``load_pretrained`` / ``unwrap`` read the model.

Which models (``decoder_for``):

- HuggingFace causal LMs (``*ForCausalLM``) whose layers all use full attention: the
  cache is a ``transformers.StaticCache`` whose layers' tensors are the buffers, and the
  model gets ``attention_mask=valid`` (so HuggingFace builds its own causal and padding
  mask) and ``position_ids=positions``;
- the zoo's ``GPT`` and ``Llama`` (``forward(idx, cache=KVCache(...))``,
  ``torchalpa/models/kv_cache.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module

from torchalpa.models.gpt import GPT
from torchalpa.models.kv_cache import KVCache
from torchalpa.models.llama import Llama, LlamaConfig

__all__ = ["CacheLayout", "Decoder", "CachedStep", "decoder_for", "CACHE_PREFIX",
           "is_cache_name"]

CACHE_PREFIX = "kv_cache."
"""The cache's buffers are named ``kv_cache.<layer>.key`` and ``kv_cache.<layer>.value``."""
_CACHE = CACHE_PREFIX.rstrip(".")


def is_cache_name(name: str) -> bool:
    return name.startswith(CACHE_PREFIX)


@dataclass(frozen=True)
class CacheLayout:
    """The shape of one layer's cache, and the model's limits."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    """The longest context the model's position embeddings cover."""
    dtype: torch.dtype


class Decoder(Protocol):
    """How to run one model family against a static cache."""

    layout: CacheLayout

    def step(self, model: nn.Module, keys: Sequence[torch.Tensor],
             values: Sequence[torch.Tensor], input_ids: torch.Tensor, positions: torch.Tensor,
             valid: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """The logits of the last new token, (B, vocab); the cache written in place."""
        ...


class _KVLayer(nn.Module):
    key: torch.Tensor
    value: torch.Tensor

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device):
        super().__init__()
        self.register_buffer("key", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("value", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)

    def reset_parameters(self) -> None:
        """A cache starts empty (zeros); ``init_weights`` finds the buffers covered."""
        with torch.no_grad():
            self.key.zero_()
            self.value.zero_()


class CachedStep(nn.Module):
    """``model`` and a static cache of ``batch_size`` x ``max_context`` slots (see the
    module docstring). The cache is built on ``device`` (``meta``: nothing allocated;
    ``torchalpa.auto_parallel`` allocates only this rank's blocks)."""

    _lm: nn.Module
    _decoder: Decoder

    def __init__(self, model: nn.Module, batch_size: int, max_context: int, *,
                 device: torch.device | str = "meta", decoder: Decoder | None = None):
        super().__init__()
        decoder = decoder if decoder is not None else decoder_for(model)
        layout = decoder.layout
        if max_context > layout.max_positions:
            raise ValueError(f"max_context={max_context} exceeds the {layout.max_positions} "
                             f"positions {type(model).__name__} has; ask for at most that")
        if _CACHE in model._modules:
            raise ValueError(f"{type(model).__name__} has a submodule named {_CACHE!r}, the "
                             "name the cache takes")
        # the model's state and submodules, under their own names (shared, not copied)
        self._parameters = model._parameters
        self._buffers = model._buffers
        for name, child in model.named_children():
            self._modules[name] = child
        shape = (batch_size, layout.num_kv_heads, max_context, layout.head_dim)
        self._modules[_CACHE] = nn.ModuleList(
            _KVLayer(shape, layout.dtype, device) for _ in range(layout.num_layers))
        # not children (no name prefix), under names no model's child takes: a module's
        # attributes shadow its children in get_submodule (an HF LM's child is "model")
        object.__setattr__(self, "_lm", model)
        object.__setattr__(self, "_decoder", decoder)
        self.batch_size, self.max_context = batch_size, max_context

    def cache_names(self) -> list[str]:
        return [n for n, _ in self.named_buffers() if is_cache_name(n)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                start: torch.Tensor) -> torch.Tensor:
        layers = [layer for layer in self.get_submodule(_CACHE).children()
                  if isinstance(layer, _KVLayer)]
        keys = [layer.key for layer in layers]
        values = [layer.value for layer in layers]
        return self._decoder.step(self._lm, keys, values, input_ids, positions, valid, start)


def _config_of(model: nn.Module) -> Any:
    """A HuggingFace model's config (typed loosely: transformers' own classes)."""
    return model.config


def _dtype_of(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


class ZooDecoder:
    """The zoo's GPT and Llama: ``model(idx, cache=KVCache(...))``."""

    def __init__(self, model: GPT | Llama):
        c = model.config
        kv_heads = c.num_kv_heads if isinstance(c, LlamaConfig) else c.num_heads
        self.layout = CacheLayout(c.num_layers, kv_heads, c.hidden // c.num_heads,
                                  c.max_seq_len, _dtype_of(model))

    def step(self, model, keys, values, input_ids, positions, valid, start) -> torch.Tensor:
        logits = model(input_ids, cache=KVCache(keys, values, start, valid, positions))
        return logits[:, -1]                                          # (B, V)


class HFDecoder:
    """A HuggingFace causal LM with full attention in every layer, through a
    ``transformers.StaticCache`` over the buffers."""

    def __init__(self, model: nn.Module):
        config = _config_of(model).get_text_config(decoder=True)
        if getattr(_config_of(model), "is_encoder_decoder", False):
            raise ValueError(f"{type(model).__name__} is an encoder-decoder; generation is "
                             "built for decoder-only causal LMs")
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise NotImplementedError(
                f"{type(model).__name__} has {', '.join(sorted(kinds - {'full_attention'}))} "
                "layers; torchalpa's static cache covers full-attention layers only")
        kv_heads, head_dim = _probe_head_shape(model)
        positions = getattr(config, "max_position_embeddings", None) or \
            getattr(config, "n_positions", None)
        if positions is None:
            raise ValueError(f"{type(model).__name__}'s config names no maximum position "
                             "(max_position_embeddings)")
        self.config = config
        self.layout = CacheLayout(config.num_hidden_layers, kv_heads, head_dim, positions,
                                  _dtype_of(model))
        self.keeps_last = "logits_to_keep" in inspect.signature(model.forward).parameters

    def step(self, model, keys, values, input_ids, positions, valid, start) -> torch.Tensor:
        from transformers.cache_utils import StaticCache
        B, KV, S, D = keys[0].shape
        cache = StaticCache(config=self.config, max_cache_len=S)
        # each layer's bookkeeping (it allocates tensors, fake ones in a capture)
        cache.early_initialization(B, KV, D, keys[0].dtype, keys[0].device)
        layer: Any
        for layer, k, v in zip(cache.layers, keys, values):
            layer.keys, layer.values = k, v              # replaced by the buffers
            layer.cumulative_length = start.clone()      # the slot of the first new token
        extra = {"logits_to_keep": 1} if self.keeps_last else {}
        out = model(input_ids=input_ids, attention_mask=valid, position_ids=positions,
                    past_key_values=cache, use_cache=True, **extra)
        return out.logits[:, -1]                                      # (B, V)


def _probe_head_shape(model: nn.Module) -> tuple[int, int]:
    """(kv heads, head dim) of the keys and values ``model`` caches, read off one token run
    on the ``meta`` device (nothing computed): configs do not say it reliably (GPT-2 and
    GPT-NeoX ignore a ``num_key_value_heads`` their config may carry)."""
    state = {n: torch.empty_like(t, device="meta")
             for n, t in [*model.named_parameters(), *model.named_buffers()]}
    token = torch.zeros(1, 1, dtype=torch.long, device="meta")
    config = _config_of(model)
    pad = config.pad_token_id
    config.pad_token_id = None        # or a model looks for padding in the (valueless) ids
    try:
        with torch.no_grad(), _reparametrize_module(model, state, tie_weights=True):
            cache = model(input_ids=token, use_cache=True).past_key_values
    finally:
        config.pad_token_id = pad
    shapes = {(tuple(layer.keys.shape), tuple(layer.values.shape)) for layer in cache.layers}
    if len(shapes) != 1:
        raise NotImplementedError(f"{type(model).__name__}'s layers cache keys and values of "
                                  f"different shapes {sorted(shapes)}; the static cache needs "
                                  "one shape")
    (key, value), = shapes
    if key != value:
        raise NotImplementedError(f"{type(model).__name__} caches keys {key} and values "
                                  f"{value} of different shapes")
    return key[1], key[3]


def decoder_for(model: nn.Module) -> Decoder:
    """How to run ``model`` against a static cache, or an error saying which models can."""
    if isinstance(model, (GPT, Llama)):
        return ZooDecoder(model)
    if callable(getattr(model, "generate", None)) and hasattr(model, "config") \
            and callable(getattr(model.config, "get_text_config", None)):
        return HFDecoder(model)
    raise TypeError(f"generation needs a causal LM torchalpa can run with a static KV cache: "
                    f"a HuggingFace *ForCausalLM or torchalpa.models GPT / Llama; got "
                    f"{type(model).__name__}")
