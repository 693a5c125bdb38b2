"""A mixture-of-experts decoder: GPT-style blocks whose MLP is a top-k routed MoE layer.

The MoE layer is GShard's, written with dense tensors so every shape is static:
a linear router and softmax give each token a distribution over experts; each token goes
to its ``top_k`` experts (first choices take buffer slots before second choices), each
expert holds at most ``capacity`` tokens (overflow is dropped, as in GShard/Switch);
dispatch and combine are one-hot einsums, and the experts' weights are batched
``(num_experts, ...)`` tensors, so the expert dim is one a plan can shard (expert
parallelism). The Switch Transformer load-balancing loss, scaled by ``aux_loss_weight``,
is returned next to the logits and added to the cross-entropy by ``loss_fn``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchalpa.models._checks import check_divisible, check_positive
from torchalpa.models.gpt import token_batch
from torchalpa.models.losses import moe_lm_loss

__all__ = ["MoEConfig", "MoELayer", "MoEModel", "example_batch", "loss_fn"]

loss_fn = moe_lm_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig:
    vocab_size: int = 32000
    """Number of token ids."""
    max_seq_len: int = 1024
    """Longest sequence; the size of the learned position table."""
    num_layers: int = 8
    """Number of transformer blocks (each with an MoE MLP)."""
    hidden: int = 1024
    """Width of the residual stream."""
    num_heads: int = 16
    """Attention heads per block."""
    intermediate: int = 4096
    """Hidden width of each expert's MLP."""
    num_experts: int = 8
    """Experts per MoE layer."""
    top_k: int = 2
    """Experts each token is routed to."""
    capacity_factor: float = 1.25
    """Expert buffer size as a multiple of an even share of the routed tokens."""
    aux_loss_weight: float = 0.01
    """Weight of the load-balancing loss in the training loss."""

    def __post_init__(self):
        check_positive(self, "vocab_size", "max_seq_len", "num_layers", "hidden", "num_heads",
                       "intermediate", "num_experts", "top_k")
        check_divisible(self, "hidden", "num_heads")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} must be <= num_experts="
                             f"{self.num_experts}")
        if self.capacity_factor <= 0 or self.aux_loss_weight < 0:
            raise ValueError("MoEConfig.capacity_factor must be > 0 and aux_loss_weight >= 0, "
                             f"got {self.capacity_factor} and {self.aux_loss_weight}")

    @classmethod
    def tiny(cls, **overrides) -> MoEConfig:
        """Two blocks of 4 experts, top-2, dims divisible by 8."""
        fields = dict(vocab_size=128, max_seq_len=16, num_layers=2, hidden=32, num_heads=4,
                      intermediate=64, num_experts=4, top_k=2)
        return cls(**{**fields, **overrides})


class MoELayer(nn.Module):
    """``forward(x (B, T, C)) -> (y (B, T, C), load-balancing loss (scalar))``."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 capacity_factor: float):
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(num_experts, hidden, intermediate) * 0.02)
        self.w_out = nn.Parameter(torch.randn(num_experts, intermediate, hidden) * 0.02)

    def capacity(self, num_tokens: int) -> int:
        return max(1, math.ceil(self.top_k * num_tokens * self.capacity_factor
                                / self.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        S, E, K = B * T, self.num_experts, self.top_k
        cap = self.capacity(S)
        tokens = x.reshape(S, C)                                             # (S, C)
        probs = F.softmax(self.router(tokens), dim=-1)                       # (S, E)
        weights, experts = probs.topk(K, dim=-1)                             # (S, K)
        weights = weights / weights.sum(dim=-1, keepdim=True)                # (S, K)
        # choice[k, s, e]: token s's k-th choice is expert e
        expert_ids = torch.arange(E, device=x.device)
        choice = (experts.t()[..., None] == expert_ids).long()               # (K, S, E)
        # each choice's slot in its expert's buffer, first choices first
        slots = choice.reshape(K * S, E).cumsum(dim=0).reshape(K, S, E) - 1  # (K, S, E)
        slot = (slots * choice).sum(dim=-1)                                  # (K, S)
        in_slot = (slot[..., None] == torch.arange(cap, device=x.device))    # (K, S, cap)
        dispatch = torch.einsum("kse,ksc->sec", choice.to(x.dtype), in_slot.to(x.dtype))
        combine = torch.einsum("ks,kse,ksc->sec", weights.t(), choice.to(x.dtype),
                               in_slot.to(x.dtype))                          # (S, E, cap)
        expert_in = torch.einsum("sec,sm->ecm", dispatch, tokens)            # (E, cap, C)
        h = F.gelu(torch.einsum("ecm,emf->ecf", expert_in, self.w_in))       # (E, cap, F)
        expert_out = torch.einsum("ecf,efm->ecm", h, self.w_out)             # (E, cap, C)
        y = torch.einsum("sec,ecm->sm", combine, expert_out)                 # (S, C)
        # Switch loss: E * sum_e (share of first choices to e) * (mean router prob of e)
        share = choice[0].to(x.dtype).mean(dim=0)                            # (E,)
        aux_loss = E * (share * probs.mean(dim=0)).sum()
        return y.reshape(B, T, C), aux_loss


class Block(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.ln_1 = nn.LayerNorm(config.hidden)
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.ln_2 = nn.LayerNorm(config.hidden)
        self.moe = MoELayer(config.hidden, config.intermediate, config.num_experts,
                            config.top_k, config.capacity_factor)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        H = self.num_heads
        q, k, v = self.qkv(self.ln_1(x)).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)          # (B, H, T, D)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))                # (B, T, C)
        y, aux_loss = self.moe(self.ln_2(x))
        return x + y, aux_loss


class MoEModel(nn.Module):
    """``forward(idx (B, T)) -> (logits (B, T, vocab_size), weighted load-balancing loss)``."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.max_seq_len, config.hidden)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))     # (B, T, C)
        aux_loss = x.new_zeros(())
        for block in self.blocks:
            x, layer_aux = block(x)                                          # (B, T, C)
            aux_loss = aux_loss + layer_aux
        logits = self.lm_head(self.ln_f(x))                                  # (B, T, V)
        return logits, self.config.aux_loss_weight * aux_loss


def example_batch(config: MoEConfig, batch_size: int, *, seq_len: int | None = None,
                  device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets), both (B, T) int64."""
    return token_batch(config.vocab_size, batch_size, seq_len or config.max_seq_len, device)
