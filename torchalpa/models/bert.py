"""A BERT style encoder with a sequence-classification head.

Post-LayerNorm blocks (attention, then a GELU MLP, each followed by add & norm), learned
position and token-type embeddings, a tanh pooler on the first ([CLS]) token, and a
linear classifier. Padding is masked through an additive attention mask built from the
``attention_mask`` input (1 = token, 0 = padding), as in HuggingFace's BERT.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchalpa.models._checks import check_divisible, check_positive, check_probability
from torchalpa.models.losses import classification_loss

__all__ = ["BertConfig", "BertClassifier", "example_batch", "loss_fn"]

loss_fn = classification_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class BertConfig:
    vocab_size: int = 30522
    """Number of token ids."""
    max_seq_len: int = 512
    """Longest sequence; the size of the position table."""
    num_layers: int = 12
    """Number of encoder layers."""
    hidden: int = 768
    """Width of the residual stream."""
    num_heads: int = 12
    """Attention heads per layer."""
    intermediate: int = 3072
    """Width of the MLP."""
    type_vocab_size: int = 2
    """Number of token types (segment A / B)."""
    num_classes: int = 2
    """Output classes of the classification head."""
    dropout: float = 0.1
    """Dropout on embeddings, attention output, MLP output and the pooled vector."""
    norm_eps: float = 1e-12
    """LayerNorm epsilon."""

    def __post_init__(self):
        check_positive(self, "vocab_size", "max_seq_len", "num_layers", "hidden", "num_heads",
                       "intermediate", "type_vocab_size", "num_classes")
        check_divisible(self, "hidden", "num_heads")
        check_probability(self, "dropout")

    @classmethod
    def tiny(cls, **overrides) -> BertConfig:
        """A few layers, dims divisible by 8."""
        fields = dict(vocab_size=128, max_seq_len=16, num_layers=2, hidden=32, num_heads=4,
                      intermediate=64, num_classes=8)
        return cls(**{**fields, **overrides})


class Embeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden)
        self.position_embeddings = nn.Embedding(config.max_seq_len, config.hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden)
        self.LayerNorm = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)                       # (T,)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(pos)
             + self.token_type_embeddings(token_type_ids))                   # (B, T, C)
        return self.dropout(self.LayerNorm(x))


class SelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.query = nn.Linear(config.hidden, config.hidden)
        self.key = nn.Linear(config.hidden, config.hidden)
        self.value = nn.Linear(config.hidden, config.hidden)
        self.output = nn.Linear(config.hidden, config.hidden)
        self.dropout = nn.Dropout(config.dropout)
        self.LayerNorm = nn.LayerNorm(config.hidden, eps=config.norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        H = self.num_heads
        q = self.query(x).view(B, T, H, C // H).transpose(1, 2)             # (B, H, T, D)
        k = self.key(x).view(B, T, H, C // H).transpose(1, 2)               # (B, H, T, D)
        v = self.value(x).view(B, T, H, C // H).transpose(1, 2)             # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)         # (B, H, T, D)
        y = self.output(y.transpose(1, 2).reshape(B, T, C))                 # (B, T, C)
        return self.LayerNorm(x + self.dropout(y))


class FeedForward(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.intermediate = nn.Linear(config.hidden, config.intermediate)
        self.output = nn.Linear(config.intermediate, config.hidden)
        self.dropout = nn.Dropout(config.dropout)
        self.LayerNorm = nn.LayerNorm(config.hidden, eps=config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.output(F.gelu(self.intermediate(x)))                       # (B, T, C)
        return self.LayerNorm(x + self.dropout(y))


class Layer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = SelfAttention(config)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(self.attention(x, mask))


class Encoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(Layer(config) for _ in range(config.num_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, mask)                                              # (B, T, C)
        return x


class BertClassifier(nn.Module):
    """``forward(input_ids, attention_mask, token_type_ids) -> logits (B, num_classes)``.

    ``attention_mask`` and ``token_type_ids`` are (B, T) int64 like ``input_ids``.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.pooler = nn.Linear(config.hidden, config.hidden)
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(config.hidden, config.num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids, token_type_ids)                      # (B, T, C)
        keep = attention_mask[:, None, None, :].bool()                      # (B, 1, 1, T)
        mask = torch.zeros(keep.shape, dtype=x.dtype, device=x.device
                           ).masked_fill(~keep, torch.finfo(x.dtype).min)    # additive
        x = self.encoder(x, mask)                                           # (B, T, C)
        pooled = torch.tanh(self.pooler(x[:, 0]))                           # (B, C)
        return self.classifier(self.dropout(pooled))                        # (B, classes)


def example_batch(config: BertConfig, batch_size: int, *, seq_len: int | None = None,
                  device=None) -> tuple[torch.Tensor, ...]:
    """(input_ids, attention_mask, token_type_ids, labels); the last quarter is padding."""
    T = seq_len or config.max_seq_len
    input_ids = torch.randint(config.vocab_size, (batch_size, T), device=device)
    attention_mask = torch.ones(batch_size, T, dtype=torch.long, device=device)
    attention_mask[:, T - T // 4:] = 0
    token_type_ids = torch.zeros(batch_size, T, dtype=torch.long, device=device)
    token_type_ids[:, T // 2:] = 1
    labels = torch.randint(config.num_classes, (batch_size,), device=device)
    return input_ids, attention_mask, token_type_ids, labels
