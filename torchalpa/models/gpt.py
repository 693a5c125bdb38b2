"""A GPT-2 style decoder, nanoGPT style: learned positions, pre-LayerNorm blocks, GELU MLP,
dropout, and the output head tied to the token embedding (one parameter, two uses).

Attention calls ``F.scaled_dot_product_attention`` (causal), as transformers' GPT-2 does
by default: on a GPU it runs a fused kernel (flash or memory-efficient) that keeps no
``T x T`` scores for backward. With attention dropout the capture writes the attention out
(matmuls, softmax, dropout), so the random draw stays visible (``torchalpa/ops/attention.py``).

``forward(idx, cache=KVCache(...))`` runs the new tokens against a static KV cache
(``torchalpa/models/kv_cache.py``): generation's prefill and one-token decode steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchalpa.models._checks import check_divisible, check_positive, check_probability
from torchalpa.models.kv_cache import KVCache
from torchalpa.models.losses import check_lm_loss, lm_loss

__all__ = ["GPTConfig", "GPT", "example_batch", "loss_fn"]

loss_fn = lm_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 50257
    """Number of token ids."""
    max_seq_len: int = 1024
    """Longest sequence; the size of the learned position table."""
    num_layers: int = 12
    """Number of transformer blocks."""
    num_heads: int = 12
    """Attention heads per block; ``hidden`` must divide evenly among them."""
    hidden: int = 768
    """Width of the residual stream (GPT-2's n_embd)."""
    dropout: float = 0.1
    """Dropout on embeddings, attention probabilities and residual branches."""
    bias: bool = True
    """Whether Linear and LayerNorm layers have a bias (GPT-2 has one)."""
    attention: str = "sdpa"
    """"sdpa": ``F.scaled_dot_product_attention`` (a fused kernel on GPUs); "eager": the
    product, mask, softmax and product written out, the ``T x T`` scores kept for backward
    (GPT-2's original code, and what Megatron-LM ran before fused attention kernels)."""
    loss: str = "eager"
    """How ``loss_fn`` computes the cross-entropy (``losses.lm_loss_for``): "eager"
    (``F.cross_entropy``, as transformers' GPT-2 does) or "fused" (``torchalpa::cross_entropy``:
    no float32 log-probabilities kept, as flash-attn's loss in llm-foundry's MPT)."""

    def __post_init__(self):
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(f"GPTConfig.attention must be 'sdpa' or 'eager', "
                             f"got {self.attention!r}")
        check_lm_loss(self)
        check_positive(self, "vocab_size", "max_seq_len", "num_layers", "num_heads", "hidden")
        check_divisible(self, "hidden", "num_heads")
        check_probability(self, "dropout")

    @classmethod
    def tiny(cls, **overrides) -> GPTConfig:
        """A few layers, dims divisible by 8: captures and trains in seconds on a CPU."""
        fields = dict(vocab_size=128, max_seq_len=16, num_layers=2, num_heads=2, hidden=32)
        return cls(**{**fields, **overrides})


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.eager = config.attention == "eager"
        self.c_attn = nn.Linear(config.hidden, 3 * config.hidden, bias=config.bias)
        self.c_proj = nn.Linear(config.hidden, config.hidden, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0
                ) -> torch.Tensor:
        B, T, C = x.shape
        H = self.num_heads
        q, k, v = self.c_attn(x).split(C, dim=2)                      # 3 x (B, T, C)
        q = q.view(B, T, H, C // H).transpose(1, 2)                   # (B, H, T, D)
        k = k.view(B, T, H, C // H).transpose(1, 2)                   # (B, H, T, D)
        v = v.view(B, T, H, C // H).transpose(1, 2)                   # (B, H, T, D)
        seen = None
        if cache is not None:  # attend over the cache's S slots, this call's tokens written in
            k, v = cache.write(layer, k, v)                           # 2 x (B, H, S, D)
            seen = cache.attention_mask(T)                            # (B, 1, T, S)
        p = self.dropout if self.training else 0.0
        if self.eager:
            y = _eager_attention(q, k, v, seen, p, self.training)   # (B, H, T, D)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, dropout_p=p,
                                               is_causal=seen is None)    # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, C)                        # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     seen: torch.Tensor | None, p: float, training: bool) -> torch.Tensor:
    """Attention written out: scores (B, H, T, S), causal (or ``seen``) mask, softmax,
    dropout, then the weighted sum (B, H, T, D)."""
    T, S = q.shape[-2], k.shape[-2]
    if seen is None:
        seen = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, T, S)
    att = att.masked_fill(~seen, float("-inf"))
    att = F.dropout(F.softmax(att, dim=-1), p, training)
    return att @ v


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden, 4 * config.hidden, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.hidden, config.hidden, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))   # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0
                ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``forward(idx (B, T) int64) -> logits (B, T, vocab_size)``; with ``cache=``, the
    tokens continue the cached ones at ``cache.positions``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.max_seq_len, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden, bias=config.bias)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight        # tied: one parameter, two uses
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}")
        if cache is None:
            pos = torch.arange(T, device=idx.device)                  # (T,)
        else:
            pos = cache.positions                                     # (B, T)
        x = self.drop(self.wte(idx) + self.wpe(pos))                  # (B, T, C)
        for i, block in enumerate(self.h):
            x = block(x, cache, i)                                    # (B, T, C)
        return self.lm_head(self.ln_f(x))                             # (B, T, V)


def _init_weights(module: nn.Module) -> None:
    """GPT-2's init: N(0, 0.02) for Linear and Embedding weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def example_batch(config: GPTConfig, batch_size: int, *, seq_len: int | None = None,
                  device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets), both (B, T) int64; random token ids (empty on ``meta``)."""
    return token_batch(config.vocab_size, batch_size, seq_len or config.max_seq_len, device)


def token_batch(vocab_size: int, batch_size: int, seq_len: int, device=None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (inputs, next-token targets) for a language model, on ``device``."""
    tokens = torch.randint(vocab_size, (batch_size, seq_len + 1), device=device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
