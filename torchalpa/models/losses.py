"""Loss functions of the zoo, written as ``loss_fn(outputs, *targets)`` for ``capture``.

Language models take targets already shifted by one token (nanoGPT's convention), so the
loss is a plain cross-entropy over every position; positions whose target is -100 are
ignored, as in PyTorch and HuggingFace.

An LM config's ``loss`` field picks how that cross-entropy runs (``lm_loss_for``): "eager"
(``F.cross_entropy``: log_softmax then nll_loss, as transformers' models and torchtitan
compute it) or "fused" (``torchalpa::cross_entropy``, ``torchalpa/ops/cross_entropy.py``:
no float32 log-probabilities kept, as flash-attn's fused loss that llm-foundry trains MPT
with).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from torchalpa.ops.cross_entropy import cross_entropy

__all__ = ["IGNORE_INDEX", "LM_LOSSES", "lm_loss", "fused_lm_loss", "lm_loss_for",
           "check_lm_loss", "classification_loss", "moe_lm_loss", "mse_loss"]

IGNORE_INDEX = -100


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``logits`` (B, T, V), ``targets`` (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


def fused_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``lm_loss`` as the fused op ``torchalpa::cross_entropy`` (the same value)."""
    return cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)


LM_LOSSES: dict[str, Callable] = {"eager": lm_loss, "fused": fused_lm_loss}
"""An LM config's ``loss`` -> its ``loss_fn``."""


def check_lm_loss(config) -> None:
    """``ValueError`` unless ``config.loss`` names one of ``LM_LOSSES``."""
    if config.loss not in LM_LOSSES:
        raise ValueError(f"{type(config).__name__}.loss must be one of "
                         f"{', '.join(map(repr, LM_LOSSES))}, got {config.loss!r}")


def lm_loss_for(config) -> Callable:
    """The LM loss ``config.loss`` names (``lm_loss`` for a config without the field)."""
    return LM_LOSSES[getattr(config, "loss", "eager")]


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
