"""HuggingFace ``transformers`` models built from configs: random weights, no download.

``hf_model("gpt2" | "llama" | "bert", **config_overrides)`` builds ``GPT2LMHeadModel``,
``LlamaForCausalLM`` or ``BertForSequenceClassification`` from a small config (override
any field, e.g. ``num_hidden_layers=32``), with the SDPA attention implementation and no
KV cache. Their forward returns a ``ModelOutput``; the loss functions here read its
``logits``: HuggingFace's causal-LM convention (labels are the input ids, shifted inside
the loss, -100 ignored) and cross-entropy for classification.

Needs ``pip install torchalpa[models]`` (transformers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchalpa.models.losses import IGNORE_INDEX

__all__ = ["HF_MODELS", "hf_model", "hf_config", "hf_example_batch", "hf_loss_fn", "hf_causal_lm",
           "causal_lm_loss", "sequence_classification_loss"]


def causal_lm_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """HuggingFace's causal-LM loss: predict token t+1 from position t; -100 is ignored."""
    logits = output["logits"][:, :-1]                                   # (B, T-1, V)
    targets = labels[:, 1:]                                             # (B, T-1)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


def sequence_classification_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``output.logits`` (B, num_labels) against ``labels`` (B,)."""
    return F.cross_entropy(output["logits"], labels)


# name -> (config class, model class, tiny config fields, loss, batch kind)
HF_MODELS: dict[str, tuple[str, str, dict[str, Any], Callable, str]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                  bos_token_id=0, eos_token_id=0),
             causal_lm_loss, "lm"),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16),
              causal_lm_loss, "lm"),
    "bert": ("BertConfig", "BertForSequenceClassification",
             dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=16, num_labels=8),
             sequence_classification_loss, "classifier"),
}


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("HuggingFace models need transformers: "
                          "pip install 'torchalpa[models]'") from e
    return transformers


def _entry(name: str):
    if name not in HF_MODELS:
        raise ValueError(f"unknown HuggingFace model {name!r}; choose from {sorted(HF_MODELS)}")
    return HF_MODELS[name]


def hf_config(name: str, **overrides):
    """The tiny config of ``name`` (a ``transformers`` config object), fields overridden."""
    config_cls, _, fields, _, _ = _entry(name)
    fields = {**fields, "use_cache": False, **overrides}
    config = getattr(_transformers(), config_cls)(**fields)
    config._attn_implementation = overrides.get("attn_implementation", "sdpa")
    return config


def hf_model(name: str, config=None, **overrides) -> nn.Module:
    """A ``transformers`` model with random weights, built on the current default device.

    Build it inside ``with torch.device("meta"):`` to allocate nothing.
    """
    _, model_cls, _, _, _ = _entry(name)
    config = config if config is not None else hf_config(name, **overrides)
    return getattr(_transformers(), model_cls)(config)


def hf_loss_fn(name: str) -> Callable:
    return _entry(name)[3]


def hf_example_batch(name: str, config, batch_size: int, *, seq_len: int | None = None,
                     device=None) -> tuple[torch.Tensor, ...]:
    """(input_ids, labels): token labels for LMs, class labels for classifiers."""
    kind = _entry(name)[4]
    T = seq_len or getattr(config, "n_positions", None) or config.max_position_embeddings
    input_ids = torch.randint(config.vocab_size, (batch_size, T), device=device)
    if kind == "lm":
        return input_ids, input_ids.clone()
    return input_ids, torch.randint(config.num_labels, (batch_size,), device=device)


def hf_causal_lm(source: str, *, batch_size: int = 8, seq_len: int | None = None,
                 device=None) -> tuple[nn.Module, tuple[torch.Tensor, ...], Callable]:
    """``(model, (input_ids, labels), causal_lm_loss)`` of any causal LM ``transformers``
    knows, from a ``model_type``'s default config ("llama", "mistral", "qwen2", ...) or a
    local ``config.json`` (a file, or a folder holding one). Nothing is downloaded; build
    it under ``torch.device("meta")`` to allocate nothing. ``seq_len`` defaults to the
    config's longest sequence, at most 2048."""
    import json
    import os
    transformers = _transformers()
    if source.endswith(".json") or os.path.isdir(source):
        path = os.path.join(source, "config.json") if os.path.isdir(source) else source
        if not os.path.isfile(path):
            raise ValueError(f"no HuggingFace config at {path}: give a config.json file or "
                             "the folder holding it")
        with open(path) as f:
            fields = json.load(f)
        model_type = fields.pop("model_type", None)
        if not model_type:
            raise ValueError(f"{path} has no model_type: it is not a transformers config")
    else:
        model_type, fields = source, {}
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(f"transformers {transformers.__version__} knows no model_type "
                         f"{model_type!r}; causal LMs include llama, mistral, qwen2, gemma, "
                         "phi3, gpt2 (or give a config.json)")
    config = transformers.AutoConfig.for_model(model_type, **fields)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    try:
        model = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise ValueError(f"{model_type!r} is not a causal language model transformers can "
                         "build (hf: names decoder LMs such as llama, mistral, qwen2, gpt2)"
                         ) from e
    longest = getattr(config, "max_position_embeddings", None) or \
        getattr(config, "n_positions", None) or 2048
    T = seq_len or min(longest, 2048)
    input_ids = torch.randint(config.vocab_size, (batch_size, T), device=device)
    return model, (input_ids, input_ids.clone()), causal_lm_loss
