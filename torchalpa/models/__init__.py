"""The model zoo: small, readable models built from frozen configs, with random weights.

Families (``FAMILIES``): ``gpt`` (GPT-2), ``llama`` (LLaMA), ``bert`` (BERT classifier),
``vit``, ``resnet``, ``moe`` (mixture-of-experts decoder), and the HuggingFace models
``hf_gpt2``, ``hf_llama``, ``hf_bert`` (``transformers``, built from configs).

A ``Workload`` is a config plus the batch it trains on: everything ``capture`` /
``torchalpa.plan`` need::

    w = torchalpa.models.llama2_13b()            # or tiny("gpt"), llama3_8b(), gpt_39b()
    with torch.device("meta"):
        model, batch = w.build(), w.example_inputs()
    torchalpa.plan(model, batch, w.loss_fn, cluster=...)

Modules:

- ``gpt`` / ``llama`` / ``bert`` / ``vit`` / ``resnet`` / ``moe``: one per family.
- ``hf``: the HuggingFace models, built from ``transformers`` configs.
- ``kv_cache``: the static KV cache the decoders read and write in generation.
- ``losses``: the zoo's ``loss_fn``s.
- ``sizes``: the batch, sequence and vocabulary sizes the model suite shares.
- ``_checks``: config validation.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from torchalpa.models import bert, gpt, hf, llama, moe, resnet, vit
from torchalpa.models.bert import BertClassifier, BertConfig
from torchalpa.models.gpt import GPT, GPTConfig
from torchalpa.models.hf import hf_model
from torchalpa.models.llama import Llama, LlamaConfig
from torchalpa.models.losses import (
    classification_loss,
    fused_lm_loss,
    lm_loss,
    lm_loss_for,
    moe_lm_loss,
    mse_loss,
)
from torchalpa.models.moe import MoEConfig, MoELayer, MoEModel
from torchalpa.models.resnet import ResNet, ResNetConfig
from torchalpa.models.vit import ViT, ViTConfig

__all__ = ["Family", "FAMILIES", "Workload", "tiny", "llama2_13b", "llama3_8b", "llama3_70b",
           "llama3_405b", "gpt_39b",
           "NAMED", "named", "ALPA_GPT", "ALPA_MOE",
           "GPT", "GPTConfig", "Llama", "LlamaConfig", "BertClassifier", "BertConfig", "ViT",
           "ViTConfig", "ResNet", "ResNetConfig", "MoEModel", "MoELayer", "MoEConfig",
           "hf_model", "lm_loss", "fused_lm_loss", "classification_loss", "moe_lm_loss", "mse_loss"]


@dataclass(frozen=True, slots=True)
class Family:
    """How to build one kind of model, a batch for it, and its loss."""

    build: Callable[[Any], nn.Module]          # config -> model
    tiny_config: Callable[..., Any]            # **overrides -> small config
    example_batch: Callable[..., tuple]        # (config, batch_size, *, [seq_len,] device)
    loss_fn: Callable
    takes_seq_len: bool = True                 # token models; image models take none

    def loss_for(self, config: Any) -> Callable:
        """``loss_fn``, or the LM loss a config's ``loss`` field names (``lm_loss_for``)."""
        return lm_loss_for(config) if self.loss_fn is lm_loss else self.loss_fn


def _hf_family(name: str) -> Family:
    return Family(build=lambda config: hf.hf_model(name, config),
                  tiny_config=lambda **kw: hf.hf_config(name, **kw),
                  example_batch=lambda config, batch_size, **kw: hf.hf_example_batch(
                      name, config, batch_size, **kw),
                  loss_fn=hf.hf_loss_fn(name))


FAMILIES: dict[str, Family] = {
    "gpt": Family(GPT, GPTConfig.tiny, gpt.example_batch, gpt.loss_fn),
    "llama": Family(Llama, LlamaConfig.tiny, llama.example_batch, llama.loss_fn),
    "bert": Family(BertClassifier, BertConfig.tiny, bert.example_batch, bert.loss_fn),
    "vit": Family(ViT, ViTConfig.tiny, vit.example_batch, vit.loss_fn, takes_seq_len=False),
    "resnet": Family(ResNet, ResNetConfig.tiny, resnet.example_batch, resnet.loss_fn,
                     takes_seq_len=False),
    "moe": Family(MoEModel, MoEConfig.tiny, moe.example_batch, moe.loss_fn),
    "hf_gpt2": _hf_family("gpt2"),
    "hf_llama": _hf_family("llama"),
    "hf_bert": _hf_family("bert"),
}


@dataclass(frozen=True, slots=True)
class Workload:
    """A model config and the batch it trains on (``seq_len`` None: the config's longest)."""

    family: str
    config: Any
    batch_size: int
    seq_len: int | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; choose from "
                             f"{sorted(FAMILIES)}")
        if self.batch_size <= 0 or (self.seq_len is not None and self.seq_len <= 0):
            raise ValueError(f"Workload batch_size={self.batch_size} and seq_len="
                             f"{self.seq_len} must be positive")

    def build(self) -> nn.Module:
        """The model, on the current default device (``with torch.device("meta")``)."""
        return FAMILIES[self.family].build(self.config)

    def example_inputs(self, device=None) -> tuple[torch.Tensor, ...]:
        """(model inputs..., targets...) for ``capture(model, inputs, loss_fn)``."""
        family = FAMILIES[self.family]
        kwargs = {"device": device}
        if family.takes_seq_len and self.seq_len is not None:
            kwargs["seq_len"] = self.seq_len
        return family.example_batch(self.config, self.batch_size, **kwargs)

    @property
    def loss_fn(self) -> Callable:
        return FAMILIES[self.family].loss_for(self.config)

    def replace(self, **changes) -> Workload:
        """A copy with ``batch_size``/``seq_len`` or config fields changed."""
        own = {k: changes.pop(k) for k in ("batch_size", "seq_len") if k in changes}
        config = self.config
        if changes and dataclasses.is_dataclass(config) and not isinstance(config, type):
            config = dataclasses.replace(config, **changes)
        elif changes:                                   # a transformers config object
            config = copy.deepcopy(config)
            for key, value in changes.items():
                setattr(config, key, value)
        return dataclasses.replace(self, config=config, **own)


def tiny(family: str, batch_size: int = 2, **config_overrides) -> Workload:
    """The family's tiny config (a few layers, dims divisible by 8): seconds on a CPU."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose from {sorted(FAMILIES)}")
    return Workload(family, FAMILIES[family].tiny_config(**config_overrides), batch_size)


def llama2_13b(*, batch_size: int = 8, seq_len: int = 4096) -> Workload:
    """LLaMA-2-13B: hidden 5120, 40 layers, 40 heads (MHA), intermediate 13824, vocab 32000."""
    config = LlamaConfig(vocab_size=32000, max_seq_len=4096, num_layers=40, hidden=5120,
                         num_heads=40, num_kv_heads=40, intermediate=13824)
    return Workload("llama", config, batch_size, seq_len)


def llama3_8b(*, batch_size: int = 16, seq_len: int = 8192) -> Workload:
    """LLaMA-3-8B: hidden 4096, 32 layers, 32 heads / 8 kv heads, intermediate 14336,
    vocab 128256, rope theta 500000."""
    config = LlamaConfig(vocab_size=128256, max_seq_len=8192, num_layers=32, hidden=4096,
                         num_heads=32, num_kv_heads=8, intermediate=14336,
                         rope_theta=500000.0)
    return Workload("llama", config, batch_size, seq_len)


def llama3_70b(*, batch_size: int = 128, seq_len: int = 8192) -> Workload:
    """LLaMA-3-70B: hidden 8192, 80 layers, 64 heads / 8 kv heads, intermediate 28672,
    vocab 128256, rope theta 500000."""
    config = LlamaConfig(vocab_size=128256, max_seq_len=8192, num_layers=80, hidden=8192,
                         num_heads=64, num_kv_heads=8, intermediate=28672,
                         rope_theta=500000.0)
    return Workload("llama", config, batch_size, seq_len)


def llama3_405b(*, batch_size: int = 64, seq_len: int = 8192) -> Workload:
    """LLaMA-3.1-405B: hidden 16384, 126 layers, 128 heads / 8 kv heads, intermediate
    53248, vocab 128256, rope theta 500000."""
    config = LlamaConfig(vocab_size=128256, max_seq_len=8192, num_layers=126, hidden=16384,
                         num_heads=128, num_kv_heads=8, intermediate=53248,
                         rope_theta=500000.0)
    return Workload("llama", config, batch_size, seq_len)


def gpt_39b(*, batch_size: int = 1024, seq_len: int = 1024) -> Workload:
    """Alpa's GPT-39B benchmark: 48 layers, hidden 8192, 64 heads, seq 1024, vocab 51200,
    global batch 1024 (Alpa's GPT suite); dropout off, as a planning workload."""
    config = GPTConfig(vocab_size=51200, max_seq_len=1024, num_layers=48, num_heads=64,
                       hidden=8192, dropout=0.0)
    return Workload("gpt", config, batch_size, seq_len)


# Alpa's benchmark suites (OSDI'22, section 8): GPT-3 sizes (seq 1024, vocab 51200) and
# GShard MoE sizes (seq 1024, vocab 32000, an MoE MLP in every block, top-2), global batch
# 1024. (hidden, layers, heads) and (hidden, layers, heads, experts).
ALPA_GPT = {"350m": (1024, 24, 16), "1.3b": (2048, 24, 32), "2.6b": (2560, 32, 32),
             "6.7b": (4096, 32, 32), "15b": (5120, 48, 40), "39b": (8192, 48, 64)}
ALPA_MOE = {"380m": (768, 8, 16, 8), "690m": (768, 8, 16, 16), "1.3b": (768, 16, 16, 16),
             "2.4b": (1024, 16, 16, 16), "10b": (1536, 16, 16, 32), "27b": (2048, 16, 16, 48),
             "70b": (2048, 32, 16, 64)}


def _alpa_gpt(hidden: int, layers: int, heads: int):
    def workload(*, batch_size: int = 1024, seq_len: int = 1024) -> Workload:
        config = GPTConfig(vocab_size=51200, max_seq_len=max(1024, seq_len), num_layers=layers,
                           num_heads=heads, hidden=hidden, dropout=0.0)
        return Workload("gpt", config, batch_size, seq_len)
    return workload


def _alpa_moe(hidden: int, layers: int, heads: int, experts: int):
    def workload(*, batch_size: int = 1024, seq_len: int = 1024) -> Workload:
        config = MoEConfig(vocab_size=32000, max_seq_len=max(1024, seq_len), num_layers=layers,
                           hidden=hidden, num_heads=heads, intermediate=4 * hidden,
                           num_experts=experts, top_k=2)
        return Workload("moe", config, batch_size, seq_len)
    return workload


NAMED: dict[str, Callable[..., Workload]] = {
    "llama3_8b": llama3_8b, "llama3_70b": llama3_70b, "llama3_405b": llama3_405b,
    "llama2_13b": llama2_13b, "gpt_39b": gpt_39b,
    **{f"alpa_gpt_{size}": _alpa_gpt(*spec) for size, spec in ALPA_GPT.items()},
    **{f"alpa_moe_{size}": _alpa_moe(*spec) for size, spec in ALPA_MOE.items()},
}
"""Real sizes by name (what the command line's MODEL accepts beside the tiny families):
each ``(*, batch_size, seq_len) -> Workload`` with the published batch and sequence."""


def named(name: str, *, batch_size: int | None = None, seq_len: int | None = None) -> Workload:
    """The real-size workload ``name`` (``NAMED``), its batch or sequence changed if given."""
    if name not in NAMED:
        raise ValueError(f"unknown model size {name!r}; the zoo names {sorted(NAMED)}")
    kwargs = {k: v for k, v in (("batch_size", batch_size), ("seq_len", seq_len))
              if v is not None}
    return NAMED[name](**kwargs)
