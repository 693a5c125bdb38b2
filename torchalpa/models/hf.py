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

__all__ = ["HF_MODELS", "hf_model", "hf_config", "hf_example_batch", "hf_loss_fn",
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
