"""A Vision Transformer (ViT) classifier: conv patch embedding, a learned [CLS] token and
position table, pre-LayerNorm blocks with GELU MLPs, and a linear head on [CLS].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchalpa.models._checks import check_divisible, check_positive, check_probability
from torchalpa.models.losses import classification_loss

__all__ = ["ViTConfig", "ViT", "example_batch", "loss_fn"]

loss_fn = classification_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class ViTConfig:
    image_size: int = 224
    """Height and width of the input images."""
    patch_size: int = 16
    """Height and width of one patch; must divide ``image_size``."""
    channels: int = 3
    """Input channels."""
    num_layers: int = 12
    """Number of transformer blocks."""
    hidden: int = 768
    """Width of the residual stream."""
    num_heads: int = 12
    """Attention heads per block."""
    mlp_ratio: int = 4
    """MLP width as a multiple of ``hidden``."""
    num_classes: int = 1000
    """Output classes."""
    dropout: float = 0.0
    """Dropout on the attention output and MLP output."""

    def __post_init__(self):
        check_positive(self, "image_size", "patch_size", "channels", "num_layers", "hidden",
                       "num_heads", "mlp_ratio", "num_classes")
        check_divisible(self, "image_size", "patch_size")
        check_divisible(self, "hidden", "num_heads")
        check_probability(self, "dropout")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def tiny(cls, **overrides) -> ViTConfig:
        """16x16 images in 4x4 patches (16 patches), two blocks, dims divisible by 8."""
        fields = dict(image_size=16, patch_size=4, num_layers=2, hidden=32, num_heads=4,
                      num_classes=8)
        return cls(**{**fields, **overrides})


class Attention(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        H = self.num_heads
        qkv = self.qkv(x).view(B, N, 3, H, C // H).permute(2, 0, 3, 1, 4)   # (3, B, H, N, D)
        q, k, v = qkv.unbind(0)                                             # (B, H, N, D)
        y = F.scaled_dot_product_attention(q, k, v)                         # (B, H, N, D)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(B, N, C)))  # (B, N, C)


class Block(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        width = config.mlp_ratio * config.hidden
        self.norm1 = nn.LayerNorm(config.hidden, eps=1e-6)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(config.hidden, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(config.hidden, width), nn.GELU(),
                                 nn.Linear(width, config.hidden), nn.Dropout(config.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """``forward(images (B, channels, H, W)) -> logits (B, num_classes)``."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = config
        self.patch_embed = nn.Conv2d(config.channels, config.hidden,
                                     kernel_size=config.patch_size, stride=config.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden))
        self.pos_embed = nn.Parameter(torch.randn(1, config.num_patches + 1, config.hidden) * .02)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden, eps=1e-6)
        self.head = nn.Linear(config.hidden, config.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        B = images.shape[0]
        x = self.patch_embed(images)                                        # (B, C, h, w)
        x = x.flatten(2).transpose(1, 2)                                    # (B, N, C)
        cls = self.cls_token.expand(B, -1, -1)                              # (B, 1, C)
        x = torch.cat((cls, x), dim=1) + self.pos_embed                     # (B, N+1, C)
        for block in self.blocks:
            x = block(x)                                                    # (B, N+1, C)
        return self.head(self.norm(x)[:, 0])                                # (B, classes)


def example_batch(config: ViTConfig, batch_size: int, *, device=None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (B, channels, H, W), labels (B,))."""
    images = torch.randn(batch_size, config.channels, config.image_size, config.image_size,
                         device=device)
    labels = torch.randint(config.num_classes, (batch_size,), device=device)
    return images, labels
