"""Plan serving OPT-175B (the published config, fp16 weights on ``meta``) for a simulated
cluster of 80 GB GPUs, without processes, as Alpa served it: ``torchalpa.plan(...,
mode="inference")`` plans the decode step (one token for each of ``--batch`` sequences
with a static KV cache of ``--context`` tokens) and the prefill of a ``--prompt``-token
prompt on its layouts, and reports per device the weights and the cache it holds, the
estimated time per token and tokens per second. Prints how long capture and planning took.

    .venv/bin/python benchmarks/plan_opt175b.py                     # 8 x H100, one node
    .venv/bin/python benchmarks/plan_opt175b.py --nodes 2           # 16 x H100, two nodes
    .venv/bin/python benchmarks/plan_opt175b.py --layers 4          # a quick look

Figures are the cost model's (``passes/pricing/cost.py``: the preset's peak flop/s, memory
bandwidth and link rates), not measurements.
"""

from __future__ import annotations

import argparse
import time

import torch

import torchalpa
from torchalpa.core.units import format_bytes

OPT_175B = dict(vocab_size=50272, hidden_size=12288, num_hidden_layers=96, ffn_dim=49152,
                num_attention_heads=96, max_position_embeddings=2048,
                word_embed_proj_dim=12288, do_layer_norm_before=True)
"""facebook/opt-175b's config.json (as published with the OPT paper's models)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=["h100", "a100"], default="h100")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=OPT_175B["num_hidden_layers"])
    args = parser.parse_args()

    import transformers
    config = transformers.OPTConfig(**dict(OPT_175B, num_hidden_layers=args.layers))
    with torch.device("meta"):
        model = transformers.OPTForCausalLM(config).to(torch.float16)
    params = sum(p.numel() for p in model.parameters())
    cluster = getattr(torchalpa.Cluster, args.preset)(args.nodes, args.gpus_per_node)
    prompts = torch.empty(args.batch, args.prompt, dtype=torch.int64, device="meta")
    print(f"OPT ({args.layers} layers, {params / 1e9:.1f}B parameters, fp16) on "
          f"{cluster.num_devices} x {args.preset.upper()} "
          f"({format_bytes(cluster.memory_per_device)} each): batch {args.batch}, "
          f"prompt {args.prompt}, context {args.context}")
    start = time.perf_counter()
    plan = torchalpa.plan(model, prompts, mode=torchalpa.Inference(max_context=args.context),
                          cluster=cluster)
    seconds = time.perf_counter() - start
    est = plan.estimates
    print(plan.summary())
    print(f"\nlogical mesh {'x'.join(map(str, plan.mesh_shape))}")
    print(f"per device: weights {format_bytes(est['weight_bytes_per_device'])}, KV cache "
          f"{format_bytes(est['kv_cache_bytes_per_device'])}, planned peak "
          f"{format_bytes(est['memory_per_device_bytes'])} of "
          f"{format_bytes(cluster.memory_per_device)}")
    print(f"estimated: {est['token_latency_s'] * 1e3:.3g} ms per token (batch {args.batch}), "
          f"{est['tokens_per_s']:.4g} tokens/s; prefill of {args.prompt} tokens "
          f"{est['prefill_time_s'] * 1e3:.4g} ms")
    print(f"captured and planned in {seconds:.0f} s on this machine")


if __name__ == "__main__":
    main()
