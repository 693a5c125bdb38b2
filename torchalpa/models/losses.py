"""Loss functions of the zoo, written as ``loss_fn(outputs, *targets)`` for ``capture``.

Language models take targets already shifted by one token (nanoGPT's convention), so the
loss is a plain cross-entropy over every position; positions whose target is -100 are
ignored, as in PyTorch and HuggingFace.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "lm_loss", "classification_loss", "moe_lm_loss", "mse_loss"]

IGNORE_INDEX = -100


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``logits`` (B, T, V), ``targets`` (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of a classifier; ``logits`` (B, num_classes), ``labels`` (B,)."""
    return F.cross_entropy(logits, labels)


def moe_lm_loss(outputs: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor
                ) -> torch.Tensor:
    """LM cross-entropy plus the (already weighted) load-balancing loss the model returns."""
    logits, aux_loss = outputs
    return lm_loss(logits, targets) + aux_loss


def mse_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error (regression heads, Alpa's MLP benchmarks)."""
    return F.mse_loss(outputs, targets)
