"""What every case of the model suite shares: its batch, sequence and vocabulary sizes,
and randomness turned off so that runs compare exactly (``suite`` and ``hf_shrink``)."""

from __future__ import annotations

__all__ = ["VOCAB", "SEQ", "BATCH", "no_randomness"]

VOCAB, SEQ, BATCH = 128, 8, 4


def no_randomness(config) -> None:
    """Dropout, stochastic depth and random masking off: runs must be comparable exactly."""
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key
                                         or "drop_path" in key or key.startswith("mask_")
                                         or key == "layerdrop"):
            setattr(config, key, 0.0)
