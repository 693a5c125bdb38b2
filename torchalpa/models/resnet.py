"""A ResNet classifier (basic residual blocks, as ResNet-18/34), torchvision's layout.

Conv2d + BatchNorm2d (with running statistics that training updates) + in-place ReLU;
a max-pooling stem, stages that halve the resolution with a strided 1x1 projection on the
shortcut, global average pooling and a linear head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from torchalpa.models._checks import check_positive
from torchalpa.models.losses import classification_loss

__all__ = ["ResNetConfig", "ResNet", "example_batch", "loss_fn"]

loss_fn = classification_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class ResNetConfig:
    widths: tuple[int, ...] = (64, 128, 256, 512)
    """Channels of each stage."""
    blocks: tuple[int, ...] = (2, 2, 2, 2)
    """Residual blocks in each stage (ResNet-18: 2, 2, 2, 2)."""
    image_size: int = 224
    """Height and width of the input images."""
    channels: int = 3
    """Input channels."""
    num_classes: int = 1000
    """Output classes."""

    def __post_init__(self):
        check_positive(self, "image_size", "channels", "num_classes")
        if len(self.widths) != len(self.blocks) or not self.widths:
            raise ValueError(f"ResNetConfig.widths {self.widths} and blocks {self.blocks} must "
                             "be non-empty and of the same length (one entry per stage)")
        if any(w <= 0 for w in self.widths) or any(b <= 0 for b in self.blocks):
            raise ValueError(f"ResNetConfig.widths {self.widths} and blocks {self.blocks} must "
                             "be positive")

    @classmethod
    def tiny(cls, **overrides) -> ResNetConfig:
        """Two stages of two blocks, 8 and 16 channels, 16x16 images."""
        fields = dict(widths=(8, 16), blocks=(2, 2), image_size=16, num_classes=8)
        return cls(**{**fields, **overrides})


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)    # (B, C', H', W')
        y = self.relu(self.bn1(self.conv1(x)))                              # (B, C', H', W')
        y = self.bn2(self.conv2(y))
        return self.relu(y + shortcut)


class ResNet(nn.Module):
    """``forward(images (B, channels, H, W)) -> logits (B, num_classes)``."""

    def __init__(self, config: ResNetConfig):
        super().__init__()
        self.config = config
        width = config.widths[0]
        self.conv1 = nn.Conv2d(config.channels, width, 3, 1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.stage_names = []
        for i, (out, num_blocks) in enumerate(zip(config.widths, config.blocks)):
            stride = 1 if i == 0 else 2
            blocks = [BasicBlock(width, out, stride)]
            blocks += [BasicBlock(out, out, 1) for _ in range(num_blocks - 1)]
            self.stage_names.append(f"layer{i + 1}")              # torchvision's names
            self.add_module(self.stage_names[-1], nn.Sequential(*blocks))
            width = out
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, config.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(images))))   # (B, C, H/2, W/2)
        for name in self.stage_names:
            x = getattr(self, name)(x)                                  # (B, C', H', W')
        x = self.avgpool(x).flatten(1)                                      # (B, C')
        return self.fc(x)                                                   # (B, classes)


def example_batch(config: ResNetConfig, batch_size: int, *, device=None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (B, channels, H, W), labels (B,))."""
    images = torch.randn(batch_size, config.channels, config.image_size, config.image_size,
                         device=device)
    labels = torch.randint(config.num_classes, (batch_size,), device=device)
    return images, labels
