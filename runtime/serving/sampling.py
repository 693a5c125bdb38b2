"""Choosing the next token from the logits: greedy, or sampling with temperature, top-k
and top-p, as HuggingFace's ``generate()`` does.

``Sampling`` holds the settings (validated: a bad value is a ValueError naming the field);
``resolve_sampling`` merges ``generate()``'s keywords over a HuggingFace model's
``generation_config`` over HuggingFace's own defaults (greedy, 20 tokens in all, top-k 50
when sampling), so a call means what it means to ``transformers``. ``next_tokens`` picks:

- greedy: the first index of the largest logit (``argmax``);
- sampling: the logits in float32, divided by the temperature, cut to the top-k, then to
  the smallest set whose probability exceeds top-p (ties with the threshold kept), then
  one ``torch.multinomial`` draw per row from ``generator`` (default: the CPU default
  generator, which ``generate`` first makes equal on every rank). The draw happens on the
  CPU: the same seed gives the same tokens on any device and any number of ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Sampling", "resolve_sampling", "next_tokens", "HF_DEFAULTS"]

HF_DEFAULTS = {"max_length": 20, "do_sample": False, "temperature": 1.0, "top_k": 50,
               "top_p": 1.0}
"""HuggingFace's defaults for what neither the call nor the model's config sets."""

_SUPPORTED = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p",
              "eos_token_id", "pad_token_id"}
# generation_config fields that do nothing at these values (anything else is a feature
# torchalpa's generate does not have)
_NEUTRAL = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0,
            "length_penalty": 1.0, "no_repeat_ngram_size": 0, "typical_p": 1.0,
            "min_length": 0, "min_new_tokens": None, "min_p": None, "top_h": None,
            "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "bad_words_ids": None,
            "suppress_tokens": None, "begin_suppress_tokens": None,
            "forced_bos_token_id": None, "forced_eos_token_id": None,
            "return_dict_in_generate": False, "output_scores": False,
            "output_logits": False, "use_cache": True}


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How ``generate`` picks and stops."""

    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    """Keep the ``top_k`` largest logits (None or 0: all)."""
    top_p: float = 1.0
    """Keep the most likely tokens whose probabilities sum past ``top_p`` (1.0: all)."""
    eos_token_ids: tuple[int, ...] = ()
    """A row is finished once it produced one of these."""
    pad_token_id: int | None = None
    """What a finished row produces from then on (needed when ``eos_token_ids`` is set)."""

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}; use "
                             "do_sample=False for greedy decoding")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be an int >= 0 or None, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.eos_token_ids and self.pad_token_id is None:
            raise ValueError("eos_token_id is set but pad_token_id is not: finished rows need "
                             "a token to continue with; pass pad_token_id=")


def _given(value) -> bool:
    return value is not None


def resolve_sampling(kwargs: Mapping, config, prompt_length: int) -> Sampling:
    """``generate()``'s keywords over ``config`` (a HuggingFace ``GenerationConfig`` or
    None) over ``HF_DEFAULTS``. Keywords of features torchalpa's ``generate`` lacks
    (beam search, repetition penalties...) are a NotImplementedError naming them."""
    unknown = sorted(k for k, v in kwargs.items() if k not in _SUPPORTED
                     and not (k in _NEUTRAL and v == _NEUTRAL[k]))
    if unknown:
        raise NotImplementedError(
            f"generate() got {', '.join(unknown)}: torchalpa's generate does greedy decoding "
            "and sampling (max_new_tokens / max_length, do_sample, temperature, top_k, "
            "top_p, eos_token_id, pad_token_id, attention_mask); use pm.unwrap().generate() "
            "on one device for the rest")
    _check_config(config)

    def pick(name) -> Any:
        if _given(kwargs.get(name)):
            return kwargs[name]
        value = getattr(config, name, None) if config is not None else None
        return value if _given(value) else HF_DEFAULTS.get(name)

    max_new: Any = kwargs.get("max_new_tokens")
    if not _given(max_new) and _given(kwargs.get("max_length")):
        max_new = kwargs["max_length"] - prompt_length
    if not _given(max_new):
        max_new = getattr(config, "max_new_tokens", None) if config is not None else None
    if not _given(max_new):
        max_new = pick("max_length") - prompt_length
    if max_new < 1:
        raise ValueError(f"nothing to generate: max_length leaves {max_new} tokens after the "
                         f"{prompt_length}-token prompt; pass max_new_tokens=")
    eos = pick("eos_token_id")
    eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple))
                                                        else [eos]))
    pad = pick("pad_token_id")
    if pad is None and eos:
        pad = eos[0]                    # as HuggingFace does (it warns)
    do_sample = bool(pick("do_sample"))
    return Sampling(max_new_tokens=int(max_new), do_sample=do_sample,
                    temperature=float(pick("temperature")), top_k=pick("top_k"),
                    top_p=float(pick("top_p")), eos_token_ids=eos,
                    pad_token_id=None if pad is None else int(pad))


def _check_config(config) -> None:
    """A model's generation_config asking for a feature torchalpa lacks is not honoured:
    say so (a warning; a keyword asking for it is an error above)."""
    if config is None:
        return
    import warnings
    ignored = [f"{k}={getattr(config, k)!r}" for k, neutral in _NEUTRAL.items()
               if getattr(config, k, None) not in (None, neutral)]
    if ignored:
        warnings.warn(f"the model's generation_config sets {', '.join(ignored)}, which "
                      "torchalpa's generate does not do: it decodes greedily or samples "
                      "without them", stacklevel=4)


def _filtered(scores: torch.Tensor, s: Sampling) -> torch.Tensor:
    """``scores`` (B, V) float32 after temperature, top-k and top-p (removed: -inf)."""
    if s.temperature != 1.0:
        scores = scores / s.temperature
    if s.top_k:
        k = min(s.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1:]                     # (B, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if s.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)            # (B, V)
        below = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - s.top_p    # the unlikely tail
        below[..., -1:] = False                                          # keep the best
        scores = scores.masked_fill(below.scatter(1, order, below), float("-inf"))
    return scores


def next_tokens(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None = None
                ) -> torch.Tensor:
    """The next token of each row of ``logits`` (B, V): (B,) int64 on the CPU."""
    scores = logits.detach().to("cpu", torch.float32)
    if not s.do_sample:
        return scores.argmax(dim=-1)
    probs = _filtered(scores, s).softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)

