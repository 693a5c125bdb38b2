"""Launched by tests/test_generate.py on 2 or 4 ranks: causal LMs built for generation
(``auto_parallel(mode="inference")``) generate beside HuggingFace's ``generate()`` on one
device, from the same weights and prompts; rank 0 writes what both produced.

Scenarios ``model:mesh`` (mesh "1d" or "2x2"): ``model`` is ``hf_gpt2``, ``hf_llama``,
``hf_opt`` (transformers models built from tiny configs), ``gpt`` or ``llama`` (the zoo's,
against their HuggingFace twins), ``sharded_llama`` (the zoo Llama with no parameter
left whole), or ``sample_llama`` (sampling with a fixed seed: top-k and top-p).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from worker_io import mesh_shape, run_scenarios  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.runtime.measurement.comm_count import CollectiveCounter  # noqa: E402
from torchalpa.runtime.measurement.issued import issued_collectives  # noqa: E402

VOCAB, CONTEXT, NEW = 128, 24, 10


def _hf(name: str):
    import transformers
    sizes = dict(vocab_size=VOCAB, initializer_range=0.3, bos_token_id=None, eos_token_id=None,
                 pad_token_id=0)
    if name == "hf_gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, **sizes)
        return transformers.GPT2LMHeadModel(config)
    if name == "hf_opt":
        config = transformers.OPTConfig(hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                        num_attention_heads=4, max_position_embeddings=32,
                                        word_embed_proj_dim=32, init_std=0.3,
                                        **{k: v for k, v in sizes.items()
                                           if k != "initializer_range"})
        return transformers.OPTForCausalLM(config)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32, **sizes)
    return transformers.LlamaForCausalLM(config)


def _zoo(name: str):
    """A zoo model with weights large enough for decisive logits, and its HF twin."""
    import torchalpa.models as zoo
    from torchalpa.models.hf_twins import hf_twin
    if name == "gpt":
        model = zoo.GPT(zoo.GPTConfig.tiny(max_seq_len=32, dropout=0.0))
    else:
        model = zoo.Llama(zoo.LlamaConfig.tiny(max_seq_len=32))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model, hf_twin(model)


def _prompts():
    """4 rows (the planned batch), the last 3 generated: row 1 left-padded by 2."""
    ids = torch.randint(3, VOCAB, (4, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


def run(name: str, mesh: str) -> dict:
    torch.manual_seed(0)
    kind = name.removeprefix("sharded_").removeprefix("sample_")
    if kind.startswith("hf_"):
        model = _hf(kind).eval()
        ref = _hf(kind).eval()
        ref.load_state_dict(model.state_dict())
    else:
        model, ref = _zoo(kind)
        ref.eval()
    torch.manual_seed(1)
    ids, mask = _prompts()
    option = torchalpa.AutoShardingOption(allow_replicated_parameters=not name.startswith("sharded_"))
    method = torchalpa.ShardParallel(logical_mesh_shape=None if mesh == "1d" else mesh_shape(mesh),
                                     auto_sharding_option=option)
    pm = torchalpa.auto_parallel(model, ids, mode=torchalpa.Inference(max_context=CONTEXT),
                                 method=method)
    rows, row_mask = ids[1:], mask[1:]
    settings = dict(max_new_tokens=NEW, pad_token_id=0)
    if name.startswith("sample_"):
        settings.update(do_sample=True, top_k=20, top_p=0.9, temperature=0.8)
    torch.manual_seed(5)
    with CollectiveCounter.for_mesh(pm.mesh) as counter:
        got = pm.generate(rows, attention_mask=row_mask, **settings)
    torch.manual_seed(5)
    again = pm.generate(rows, attention_mask=row_mask, **settings)
    torch.manual_seed(5)
    expected = ref.generate(rows, attention_mask=row_mask, **settings)
    prefill_plan = pm.prefill_plans()[rows.shape[1]]
    steps = got.shape[1] - rows.shape[1]
    planned = issued_collectives(prefill_plan) + issued_collectives(pm.plan) * (steps - 1)
    cache = pm.kv_cache()
    return {"tokens": got.tolist(), "again": again.tolist(), "expected": expected.tolist(),
            "mesh": list(pm.plan.mesh_shape), "mode": pm.plan.mode,
            "executed": sorted([r.kind, r.axis, r.bytes] for r in counter.records),
            "planned": sorted([c.kind, c.axis, c.bytes] for c in planned),
            "cache_placements": sorted({str(t.placements) for t in cache.values()}),
            "cache_bytes": pm.cache_bytes(),
            "cache_whole_bytes": sum(t.numel() * t.element_size() for t in cache.values()),
            "steps": steps,
            "weight_whole_bytes": sum(p.numel() * p.element_size()
                                      for p in pm.module.parameters()),
            "whole_params": sorted(v.name for v in pm.plan.parameters
                                   if all(str(p) == "R" for p in v.placements)
                                   and not v.name.startswith("kv_cache."))}


def main() -> None:
    run_scenarios(run)


if __name__ == "__main__":
    main()
