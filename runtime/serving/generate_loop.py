"""The generation loop over a prefill and a decode program, as HuggingFace's ``generate``
runs it, with the cache of fixed size those programs were planned for.

``Batch`` is a prompt laid out as the programs take it: ``batch_size`` rows (the planned
batch; a smaller batch is padded with copies of its first row, whose tokens are dropped),
``max_context`` cache slots. Row ``b``'s slot ``t`` holds the ``t``-th token fed for it,
padding included; ``valid`` marks the slots with real tokens; position ids count each
row's real tokens from 0 (HuggingFace's ``cumsum(attention_mask) - 1``, padding at 0).

``generate_tokens`` runs the prefill once (every prompt token, start slot 0), then the
decode step once per further token (one token, at slot ``prompt length + i``); the next
token comes from ``runtime.serving.sampling.next_tokens``. With end-of-sequence ids, a row that
produced one continues with the pad id, and the loop stops when every row has: the result
is ``(rows, prompt length + tokens generated)``, as ``transformers`` returns it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchalpa.runtime.serving.sampling import Sampling, next_tokens

__all__ = ["Batch", "prepare_batch", "generate_tokens", "StepFn"]

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``(input_ids (B, T), positions (B, T), valid (B, S), start slot) -> logits (B, V)`` of
the last new token: a prefill (T = prompt length) or the decode step (T = 1)."""


@dataclass
class Batch:
    """A prompt as the programs take it (see the module docstring)."""

    input_ids: torch.Tensor     # (rows, T): what the user gave
    ids: torch.Tensor           # (batch_size, T)
    positions: torch.Tensor     # (batch_size, T)
    valid: torch.Tensor         # (batch_size, max_context) bool
    rows: int


def prepare_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                  batch_size: int, max_context: int, max_new_tokens: int) -> Batch:
    """Check ``input_ids`` (rows, T) and its ``attention_mask`` against the planned batch
    and context (a ValueError naming the limit) and lay them out as ``Batch``."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or \
            input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be a (batch, tokens) tensor of token ids, got "
                        f"{_describe(input_ids)}")
    rows, T = input_ids.shape
    if rows < 1 or T < 1:
        raise ValueError(f"input_ids is empty: {tuple(input_ids.shape)}")
    if rows > batch_size:
        raise ValueError(f"a batch of {rows} prompts does not fit the planned cache of "
                         f"{batch_size} sequences; generate at most {batch_size} at a time, "
                         f"or build with example inputs of batch {rows}")
    if T + max_new_tokens > max_context:
        raise ValueError(f"a {T}-token prompt plus max_new_tokens={max_new_tokens} needs "
                         f"{T + max_new_tokens} cache slots, but the cache holds "
                         f"max_context={max_context} tokens per sequence; generate at most "
                         f"{max(max_context - T, 0)} new tokens, or build with "
                         f"torchalpa.Inference(max_context=...) up to the model's positions")
    if attention_mask is None:
        mask = torch.ones(rows, T, dtype=torch.bool)
    else:
        if tuple(attention_mask.shape) != (rows, T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, "
                             f"input_ids {(rows, T)}; they must match")
        mask = attention_mask.detach().to("cpu").bool()
        if not mask.any(dim=1).all():
            raise ValueError("a row of attention_mask masks every token: each prompt needs "
                             "at least one real token")
    ids = input_ids.detach().to("cpu", torch.int64)
    extra = batch_size - rows          # the planned batch: pad with copies of row 0
    ids = torch.cat([ids, ids[:1].expand(extra, T)])
    mask = torch.cat([mask, mask[:1].expand(extra, T)])
    positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 0)    # (B, T)
    valid = torch.zeros(batch_size, max_context, dtype=torch.bool)
    valid[:, :T] = mask
    return Batch(input_ids=input_ids, ids=ids, positions=positions, valid=valid, rows=rows)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')} tensor"
    return type(x).__name__


@torch.no_grad()
def generate_tokens(prefill: StepFn, decode: StepFn, batch: Batch, s: Sampling,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Prompt and generated tokens, ``(rows, T + n)`` on ``input_ids``' device (see the
    module docstring)."""
    rows, T = batch.input_ids.shape
    eos = torch.tensor(s.eos_token_ids, dtype=torch.int64)
    unfinished = torch.ones(rows, dtype=torch.bool)
    valid, position = batch.valid.clone(), batch.positions[:, -1:]      # (B, S), (B, 1)
    logits = prefill(batch.ids, batch.positions, valid, 0)
    generated = []
    for i in range(s.max_new_tokens):
        token = next_tokens(logits[:rows], s, generator)                 # (rows,)
        if len(eos):
            token = torch.where(unfinished, token, s.pad_token_id or 0)
            unfinished &= ~torch.isin(token, eos)
        generated.append(token)
        if i == s.max_new_tokens - 1 or (len(eos) and not unfinished.any()):
            break
        slot = T + i
        valid[:, slot] = True
        position = position + 1
        fed = torch.cat([token, token[:1].expand(len(valid) - rows)])[:, None]   # (B, 1)
        logits = decode(fed, position, valid, slot)
    out = torch.stack(generated, dim=1).to(batch.input_ids.device, batch.input_ids.dtype)
    return torch.cat([batch.input_ids, out], dim=1)
