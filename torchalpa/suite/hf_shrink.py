"""Any transformers architecture with its default config, shrunk in size, and its batch.

``torchalpa.suite.cases`` shrinks a few dozen configs by hand; ``benchmarks/hf_sweep.py``
tries every architecture transformers registers, so it needs a shrinker that knows no
particular model: it walks the default config (``AutoConfig.for_model(model_type)``) and
its sub-configs (``text_config``, ``vision_config``, ...) and makes small whatever has a
common size name -- layers 2, hidden 32 with 4 heads of 8 (2 key/value heads where the
model groups them), feed-forward 64, vocabulary 128, 4 experts of which 2 per token,
images 32 x 32 -- then builds the config again from those values, so sizes the config
derives in ``__init__`` follow. Lists with one entry per layer keep the entries of the
layers kept; token ids past the vocabulary are moved inside it. ``OVERRIDES`` holds the
few per-model values the generic names cannot say. Everything else (``use_cache``,
attention kinds, activations, position encodings) keeps its default; randomness
(dropout, stochastic depth) is switched off as in the suite.
"""

from __future__ import annotations

from typing import Any

import torch

from torchalpa.models.sizes import BATCH, SEQ, VOCAB, no_randomness

__all__ = ["shrunk_config", "build_model", "example_batch", "OVERRIDES", "NUM_LABELS"]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 4, 2, 8, 64, 2
IMAGE, NUM_LABELS, MAX_PARAMS = 32, 3, 20_000_000

_LAYERS = {"num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers",
           "decoder_layers", "num_decoder_layers", "num_encoder_layers"}
_HIDDEN = {"hidden_size", "n_embd", "d_model", "dim", "n_embed", "word_embed_proj_dim",
           "d_embed", "emb_dim", "embedding_dim", "model_dim", "attention_hidden_size",
           "pooler_hidden_size", "hidden_size_per_layer_input"}
_FFN = {"intermediate_size", "ffn_dim", "n_inner", "d_ff", "hidden_dim", "encoder_ffn_dim",
        "decoder_ffn_dim", "ffn_hidden_size", "d_inner", "inner_hidden_size", "mlp_dim",
        "moe_intermediate_size", "shared_expert_intermediate_size",
        "shared_intermediate_size"}
_HEADS = {"num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
          "decoder_attention_heads", "swa_num_attention_heads", "linear_num_value_heads",
          "linear_num_heads", "mamba_n_heads", "n_mamba_heads"}
_KV_HEADS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
             "swa_num_key_value_heads", "linear_num_key_heads"}
_HEAD_DIM = {"head_dim", "d_kv", "d_head", "kv_channels", "attention_head_dim",
             "swa_head_dim", "linear_key_head_dim", "linear_value_head_dim",
             "linear_head_dim", "mamba_d_head", "qk_head_dim", "v_head_dim",
             "qk_nope_head_dim", "qk_rope_head_dim", "index_head_dim"}
_SMALL = {   # name -> the value it gets (when the default is larger)
    "kv_lora_rank": 16, "q_lora_rank": 16, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2, "moe_layer_start_index": 0,
    "moe_layer_end_index": 1, "moe_layer_interval": 1, "expert_layer_period": 1,
    "expert_layer_offset": 0, "interleave_moe_layer_step": 1, "zero_expert_num": 1,
    "expert_ffn_hidden_size": FFN, "moe_shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32, "n_shared_experts": 1,
    "num_shared_experts": 1, "moe_num_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "num_expert_group": 1, "first_k_dense_replace": 1, "embedding_size": 16,
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_seq_len": 128,
    "mamba_d_state": 16, "state_size": 16, "mamba_n_groups": 1, "n_groups": 1,
    "mamba_chunk_size": 8, "chunk_size": 8, "time_step_rank": 8, "mamba_dt_rank": 8,
    "index_n_heads": 2, "index_topk": 8, "num_nextn_predict_layers": 0,
    "projection_dim": 32, "vocab_size_per_layer_input": VOCAB, "rotary_dim": 4,
    "image_size": IMAGE, "num_dense_layers": 1, "num_kv_shared_layers": 0,
    "attn_layer_period": 2, "attn_layer_offset": 1,  # Jamba: layer 1 of 2 is attention
    "num_groups": 2,            # group norm (BiT): must divide the narrowed bottlenecks' 4
}
_TOKEN_ID_SUFFIXES = ("_token_id", "_token_index", "_index", "_id")


def _kept_layers(d: dict, layers: int) -> list[int]:
    """Indices of the layers kept: the first layer of each kind ``layer_types`` lists (so a
    hybrid model keeps its sliding/full or linear/full mix), then the first ones."""
    kinds = d.get("layer_types") or d.get("layers_block_type") or []
    keep: list[int] = []
    for i, kind in enumerate(kinds):
        if kind not in [kinds[j] for j in keep] and len(keep) < LAYERS:
            keep.append(i)
    for i in range(layers):
        if len(keep) >= LAYERS:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def shrink(d: dict, model_type: str = "") -> dict:
    """The changed fields of config dict ``d`` (sub-config dicts shrunk too)."""
    out: dict[str, Any] = {}
    layers = next((d[k] for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
                   if isinstance(d.get(k), int)), None)
    keep = _kept_layers(d, layers) if layers else []
    vocab = d.get("vocab_size")
    for key, value in d.items():
        if isinstance(value, dict) and value and layers and all(
                str(k).isdigit() for k in value):        # per layer: the kept ones, renumbered
            out[key] = {type(k)(keep.index(int(k))): v for k, v in value.items()
                        if int(k) in keep}
        elif isinstance(value, dict) and (key.endswith("_config") or "model_type" in value):
            out[key] = {**value, **shrink(value)}
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int) and key in _KV_HEADS and any(
                d.get(h) == value for h in _HEADS):  # as many as the queries: stays so
            out[key] = HEADS
        elif isinstance(value, int):
            new = _shrink_int(key, value)
            if new is not None and new != value:
                out[key] = new
        elif isinstance(value, list) and layers and len(value) == layers and layers > LAYERS:
            out[key] = [value[i] for i in keep]          # one entry per layer
    out.update(_layer_lists(d, layers, keep))
    if all(isinstance(d.get(k), int) for k in ("qk_head_dim", "qk_nope_head_dim",
                                                "qk_rope_head_dim")):
        # MLA: the query/key head is its no-position part and its rotary part, side by side
        out["qk_head_dim"] = sum(out.get(k, d[k]) for k in ("qk_nope_head_dim",
                                                            "qk_rope_head_dim"))
    if isinstance(vocab, int) and vocab > VOCAB:
        out["vocab_size"] = VOCAB
        out.update(_token_ids_inside(d, VOCAB))
    if isinstance(d.get("depths"), list):                # vision stages: one block each
        out.update(_vision_stages(d))
    if isinstance(d.get("mamba_d_head"), int) and isinstance(d.get("mamba_expand"), int):
        # Mamba2 heads tile the expanded width: n_heads * d_head == expand * hidden
        heads = out.get("mamba_n_heads", d.get("mamba_n_heads")) or 1
        hidden = out.get("hidden_size", d.get("hidden_size"))
        out["mamba_d_head"] = d["mamba_expand"] * hidden // heads
    return out


def _layer_lists(d: dict, layers: int | None, keep: list[int]) -> dict:
    """Layer lists that are not one entry per layer: a repeating pattern of block kinds
    (``block_types``) becomes each kind once, so the kept layers still hold every kind;
    lists of layer indices (``hybrid_layer_ids``) keep the kept layers, renumbered."""
    out: dict[str, Any] = {}
    if not layers or layers <= LAYERS:
        return out
    kinds = d.get("block_types")
    if isinstance(kinds, list) and kinds and len(kinds) != layers \
            and all(isinstance(k, str) for k in kinds):
        out["block_types"] = list(dict.fromkeys(kinds))[:LAYERS]
    ids = d.get("hybrid_layer_ids")
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        out["hybrid_layer_ids"] = [keep.index(i) for i in ids if i in keep]
    return out


def _shrink_int(key: str, value: int) -> int | None:
    if key in _LAYERS:
        return min(value, LAYERS)
    if key in _HIDDEN:
        return min(value, HIDDEN)
    if key in _FFN:
        return min(value, FFN)
    if key in _HEADS:
        return min(value, HEADS)
    if key in _KV_HEADS:
        return min(value, KV_HEADS)
    if key in _HEAD_DIM:
        return min(value, HEAD_DIM)
    if key in _SMALL:
        return min(value, _SMALL[key])
    return None


def _token_ids_inside(d: dict, vocab: int) -> dict:
    """Special token ids at or past ``vocab`` moved to distinct ids below it (from the
    top down), so embeddings and masks keep finding them."""
    out: dict[str, Any] = {}
    free = iter(range(vocab - 1, 2, -1))
    seen: dict[int, int] = {}

    def inside(v):
        if isinstance(v, list):
            return [inside(x) for x in v]
        if isinstance(v, int) and not isinstance(v, bool) and v >= vocab:
            if v not in seen:
                seen[v] = next(free)
            return seen[v]
        return v
    for key, value in d.items():
        if key.endswith(_TOKEN_ID_SUFFIXES) and key not in ("semantic_loss_ignore_index",):
            new = inside(value)
            if new != value:
                out[key] = new
    return out


def _vision_stages(d: dict) -> dict:
    """Hierarchical vision backbones (Swin, ConvNeXt, ResNet, ...): one block per stage,
    narrow stages, heads that divide them."""
    n = len(d["depths"])
    out: dict[str, Any] = {"depths": [1] * n}
    for key in ("hidden_sizes", "embed_dims", "embed_dim", "dims"):
        v = d.get(key)
        if isinstance(v, list) and len(v) == n:
            out[key] = [16 * 2 ** i for i in range(n)]
        elif isinstance(v, int) and not isinstance(v, bool):
            out[key] = 16
    for key in ("num_heads", "num_attention_heads"):
        v = d.get(key)
        if isinstance(v, list) and len(v) == n:
            out[key] = [2 * 2 ** i for i in range(n)]
    return out


OVERRIDES: dict[str, dict] = {
    # per-model values the generic names cannot say (model_type -> config fields)
    "dots3_note_text": {"qk_nope_head_dim": 4, "qk_rope_head_dim": 4},   # swa heads: 4 + 4
    "blt": {"encoder_hash_byte_group_vocab": 64, "hidden_size_global": HIDDEN},
}


def shrunk_config(model_type: str, task: str):
    """The default config of ``model_type``, shrunk (``shrink``) and with ``OVERRIDES``."""
    from transformers import AutoConfig
    default = AutoConfig.for_model(model_type).to_dict()
    fields = {**shrink(default, model_type), **OVERRIDES.get(model_type, {})}
    if task in ("seqcls", "imgcls"):
        fields["num_labels"] = NUM_LABELS
        if task == "seqcls" and default.get("pad_token_id") is None \
                and "pad_token_id" not in fields:
            fields["pad_token_id"] = 0       # decoders classify the last non-padding token
    config = AutoConfig.for_model(model_type, **fields)
    no_randomness(config)
    for sub in ("text_config", "vision_config", "audio_config", "encoder_config",
                "decoder_config"):
        if getattr(config, sub, None) is not None and hasattr(getattr(config, sub), "to_dict"):
            no_randomness(getattr(config, sub))
    return config


def build_model(task: str, model_type: str, cls_name: str) -> torch.nn.Module:
    """``cls_name`` of transformers with the shrunk config and random weights on the CPU;
    refuses (``ValueError``) a model the shrinker left above ``MAX_PARAMS`` parameters,
    counted on the meta device first."""
    import transformers
    cls = getattr(transformers, cls_name)
    config = shrunk_config(model_type, task)
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in cls(config).parameters())
    except ImportError:
        raise                 # a package the model wants: no config is to blame
    except Exception as e:
        _check_default_builds(cls, model_type, e)
        raise
    if size > MAX_PARAMS:
        raise ValueError(f"skip: shrinker left {size / 1e6:.0f}M parameters")
    return cls(config)


def _check_default_builds(cls, model_type: str, error: Exception) -> None:
    """Raise a 'skip: default config does not build' error if the unshrunk default config
    fails too (on the meta device): then the shrinker is not to blame."""
    from transformers import AutoConfig
    try:
        with torch.device("meta"):
            cls(AutoConfig.for_model(model_type))
    except Exception as e:
        raise ValueError(f"skip: default config does not build "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:120]})") from error


def example_batch(task: str, model: torch.nn.Module) -> dict:
    """The batch the suite would give: token ids (their own labels for LMs, a class for
    sequence classification) or images and classes."""
    config = model.config
    if task == "imgcls":
        vision = getattr(config, "vision_config", None) or config
        channels = getattr(vision, "num_channels", 3) or 3
        size = getattr(vision, "image_size", IMAGE) or IMAGE
        size = size[0] if isinstance(size, (list, tuple)) else size
        return {"pixel_values": torch.randn(BATCH, channels, size, size),
                "labels": torch.randint(NUM_LABELS, (BATCH,))}
    text = getattr(config, "text_config", None) or config
    vocab = getattr(text, "vocab_size", VOCAB) or VOCAB
    ids = torch.randint(3, min(vocab, VOCAB - 28), (BATCH, SEQ))   # below moved ids
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch["labels"] = torch.randint(NUM_LABELS, (BATCH,)) if task == "seqcls" else ids
    return batch
