"""The static KV cache the zoo's decoders (GPT, Llama) read and write: ``KVCache``.

Generation keeps, per layer, a key and a value tensor of shape ``(B, KV, S, D)``: B
sequences, KV key/value heads, S cache slots (the context the cache holds), D the head
dim. A forward given ``cache=`` computes T new tokens: it writes their keys and values
into slots ``start .. start + T - 1`` in place (so a captured step returns the new cache
as an updated buffer, and its shapes never change) and attends over all S slots, masked
by ``attention_mask``.

Slots hold tokens in the order they were fed, padding included: a left-padded prompt of
T tokens fills slots ``0 .. T-1``, and ``valid`` marks the slots holding real tokens.
``positions`` are the new tokens' position ids (a padded row's real tokens count from 0),
as HuggingFace's ``generate`` computes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["KVCache"]


@dataclass
class KVCache:
    """One forward's view of the cache (see the module docstring)."""

    keys: Sequence[torch.Tensor]
    """Per layer, ``(B, KV, S, D)``; written in place."""
    values: Sequence[torch.Tensor]
    """Per layer, ``(B, KV, S, D)``; written in place."""
    start: torch.Tensor
    """``()`` int64: the slot of the first new token."""
    valid: torch.Tensor
    """``(B, S)`` bool: which slots hold a real token (the new ones included)."""
    positions: torch.Tensor
    """``(B, T)`` int64: the new tokens' position ids."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' ``k``, ``v`` (B, KV, T, D) of ``layer`` in their slots;
        returns the layer's whole cache (B, KV, S, D)."""
        slots = torch.arange(k.shape[2], device=k.device) + self.start       # (T,)
        self.keys[layer].index_copy_(2, slots, k.to(self.keys[layer].dtype))
        self.values[layer].index_copy_(2, slots, v.to(self.values[layer].dtype))
        return self.keys[layer], self.values[layer]

    def attention_mask(self, num_new: int) -> torch.Tensor:
        """``(B, 1, T, S)`` bool, True where a new token may attend: a slot at or before
        its own that holds a real token, and always its own slot (so a padding token's
        row is never empty: its output is unused, but must stay finite)."""
        S = self.valid.shape[1]
        device = self.valid.device
        query = (torch.arange(num_new, device=device) + self.start)[:, None]   # (T, 1)
        slot = torch.arange(S, device=device)[None, :]                          # (1, S)
        seen = (slot <= query)[None, None] & self.valid[:, None, None, :]       # (B, 1, T, S)
        return seen | (slot == query)[None, None]
