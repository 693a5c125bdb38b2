"""The zoo's decoders as HuggingFace models with the same weights: ``hf_twin(model)``.

``GPT`` becomes a ``GPT2LMHeadModel`` (exact GELU, as the zoo's MLP; Conv1D weights are
the transposes of the zoo's ``nn.Linear`` ones) and ``Llama`` a ``LlamaForCausalLM``
(the zoo already uses HuggingFace's parameter names, under ``model.``). The twin computes
what the zoo model computes, so HuggingFace's own ``generate()`` is a reference for
torchalpa's (tests, ``benchmarks/generate.py``). Dropout is set to the zoo config's; call
``.eval()`` on both to compare. Needs ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from torchalpa.models.gpt import GPT
from torchalpa.models.llama import Llama

__all__ = ["hf_twin"]


def hf_twin(model: nn.Module) -> Any:
    """A ``transformers`` model holding a copy of ``model``'s weights (a zoo GPT or
    Llama, on a real device) that computes the same logits."""
    twin: Any
    if isinstance(model, GPT):
        twin, weights = _gpt2(model)
    elif isinstance(model, Llama):
        twin, weights = _llama(model)
    else:
        raise TypeError(f"hf_twin takes a torchalpa.models GPT or Llama, got "
                        f"{type(model).__name__}")
    missing, unexpected = twin.load_state_dict(weights, strict=False)
    # GPT-2's causal-mask buffers are not weights; anything else must have been mapped
    assert not unexpected and all(".attn.bias" in k or "masked_bias" in k for k in missing), \
        (missing, unexpected)
    return twin.to(next(model.parameters()).dtype)


def _gpt2(model: GPT):
    import transformers
    c = model.config
    if not c.bias:
        raise ValueError("GPT-2 has biases: hf_twin needs a GPTConfig with bias=True")
    config = transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.max_seq_len, n_embd=c.hidden,
        n_layer=c.num_layers, n_head=c.num_heads, activation_function="gelu",
        resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout,
        layer_norm_epsilon=1e-5, bos_token_id=None, eos_token_id=None, tie_word_embeddings=True)
    state = model.state_dict()
    conv1d = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight",
              ".mlp.c_proj.weight")    # HF's Conv1D stores (in, out)
    weights = {}
    for name, value in state.items():
        if name == "lm_head.weight":
            continue                    # tied to wte
        weights[f"transformer.{name}"] = value.t().contiguous() if name.endswith(conv1d) \
            else value
    weights["lm_head.weight"] = state["lm_head.weight"]
    return transformers.GPT2LMHeadModel(config), weights


def _llama(model: Llama):
    import transformers
    c = model.config
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden, intermediate_size=c.intermediate,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps, rope_parameters={"rope_type": "default",
                                                  "rope_theta": c.rope_theta},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    weights = {(name if name.startswith("lm_head.") else f"model.{name}"): value
               for name, value in model.state_dict().items()}
    return transformers.LlamaForCausalLM(config), weights
