"""A LLaMA style decoder: RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query
attention through ``F.scaled_dot_product_attention(is_causal=True)``, untied output head.

Names follow the HuggingFace checkpoints (``layers.3.self_attn.q_proj``, ``mlp.down_proj``),
so plans read the way LLaMA users know them. The rotary tables are computed in ``forward``
from ``arange`` (not stored as buffers), so a model built on ``meta`` needs no
re-initialization of them before it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchalpa.models._checks import check_divisible, check_positive
from torchalpa.models.gpt import token_batch
from torchalpa.models.kv_cache import KVCache
from torchalpa.models.losses import check_lm_loss, lm_loss

__all__ = ["LlamaConfig", "Llama", "example_batch", "loss_fn"]

loss_fn = lm_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig:
    vocab_size: int = 32000
    """Number of token ids."""
    max_seq_len: int = 4096
    """Longest sequence (the training sequence length of the big presets)."""
    num_layers: int = 32
    """Number of decoder layers."""
    hidden: int = 4096
    """Width of the residual stream."""
    num_heads: int = 32
    """Query heads per layer."""
    num_kv_heads: int = 32
    """Key/value heads (grouped-query attention when fewer than ``num_heads``)."""
    intermediate: int = 11008
    """Width of the SwiGLU MLP."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    loss: str = "eager"
    """How ``loss_fn`` computes the cross-entropy (``losses.lm_loss_for``): "eager"
    (``F.cross_entropy``, as transformers' Llama and torchtitan do) or "fused"
    (``torchalpa::cross_entropy``: no float32 log-probabilities kept)."""

    def __post_init__(self):
        check_lm_loss(self)
        check_positive(self, "vocab_size", "max_seq_len", "num_layers", "hidden", "num_heads",
                       "num_kv_heads", "intermediate")
        check_divisible(self, "hidden", "num_heads")
        check_divisible(self, "num_heads", "num_kv_heads")
        if (self.hidden // self.num_heads) % 2:
            raise ValueError(f"LlamaConfig: head dim hidden/num_heads="
                             f"{self.hidden // self.num_heads} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @classmethod
    def tiny(cls, **overrides) -> LlamaConfig:
        """A few layers, dims divisible by 8, 2 query heads per kv head."""
        fields = dict(vocab_size=128, max_seq_len=16, num_layers=2, hidden=32, num_heads=4,
                      num_kv_heads=2, intermediate=64)
        return cls(**{**fields, **overrides})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.type_as(x)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each (T, D)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)   # (T, D/2)
    angles = torch.cat((angles, angles), dim=-1)                                  # (T, D)
    return angles.cos(), angles.sin()


def rotary_at(positions: torch.Tensor, head_dim: int, theta: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin at each row's own ``positions`` (B, T), each (B, 1, T, D): a padded
    batch's rows start counting at their first real token."""
    device = positions.device
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = positions[..., None].float() * inv_freq                              # (B, T, D/2)
    angles = torch.cat((angles, angles), dim=-1)[:, None]                         # (B, 1, T, D)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of ``x`` (B, H, T, D) by the position's angle, in the
    tables' float32, back in ``x``'s dtype (a bfloat16 model stays bfloat16)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)                        # (B, H, T, D)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden, config.num_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden, config.num_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)          # (B, H, T, D)
        k = self.k_proj(x).view(B, T, KV, D).transpose(1, 2)         # (B, KV, T, D)
        v = self.v_proj(x).view(B, T, KV, D).transpose(1, 2)         # (B, KV, T, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        seen = None
        if cache is not None:     # attend over the cache's S slots, this call's tokens in
            k, v = cache.write(layer, k, v)                          # 2 x (B, KV, S, D)
            seen = cache.attention_mask(T)                           # (B, 1, T, S)
        k, v = repeat_kv(k, H // KV), repeat_kv(v, H // KV)          # (B, H, T or S, D)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen,
                                           is_causal=seen is None)   # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))   # (B, T, C)


def repeat_kv(x: torch.Tensor, times: int) -> torch.Tensor:
    """(B, KV, T, D) -> (B, KV * times, T, D): each kv head serves ``times`` query heads."""
    if times == 1:
        return x
    B, KV, T, D = x.shape
    return x[:, :, None].expand(B, KV, times, T, D).reshape(B, KV * times, T, D)


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden, config.intermediate, bias=False)
        self.up_proj = nn.Linear(config.hidden, config.intermediate, bias=False)
        self.down_proj = nn.Linear(config.intermediate, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))   # (B, T, C)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """``forward(idx (B, T) int64) -> logits (B, T, vocab_size)``; with ``cache=``, the
    tokens continue the cached ones at ``cache.positions``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)   # untied

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}")
        if cache is None:
            cos, sin = rotary_tables(T, self.config.head_dim, self.config.rope_theta,
                                     idx.device)                      # 2 x (T, D)
        else:
            cos, sin = rotary_at(cache.positions, self.config.head_dim,
                                 self.config.rope_theta)              # 2 x (B, 1, T, D)
        x = self.embed_tokens(idx)                                    # (B, T, C)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i)                          # (B, T, C)
        return self.lm_head(self.norm(x))                             # (B, T, V)


def example_batch(config: LlamaConfig, batch_size: int, *, seq_len: int | None = None,
                  device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets), both (B, T) int64."""
    return token_batch(config.vocab_size, batch_size, seq_len or config.max_seq_len, device)
