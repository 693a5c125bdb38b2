"""A small GPT's intra-op plan on 4 H100 (1 x 4 and 2 x 2), with the fused cross-entropy
and with eager's: how the fused loss lays out its logits and what the plan estimates, to
compare two commits (the fused loss's split by vocabulary against tokens only):

    git archive <commit> | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 python benchmarks/in_tree.py /tmp/base benchmarks/vocab_loss_plans.py
    OMP_NUM_THREADS=1 python benchmarks/vocab_loss_plans.py

GPT: width 512, 8 heads, 2 blocks, vocabulary 32768, 8 x 512 tokens, no dropout (the head's
logits, 4096 x 32768, are most of its activations). Each line: mesh, loss, the fused
loss's logits layout (forward's first operand), the estimated step and memory per
device, and a digest of every op's strategy (the eager rows: the same plan on both
commits where only the fused op's rule changed).
"""

from __future__ import annotations

import hashlib
import json
import os

os.environ["TORCHALPA_CACHE"] = "0"
import torch

import torchalpa
import torchalpa.models as zoo

CONFIG = dict(vocab_size=32768, hidden=512, num_heads=8, num_layers=2, max_seq_len=512,
              dropout=0.0)


def plan_row(shape: tuple[int, int], loss: str) -> dict:
    """The plan of the GPT with ``loss`` on a ``shape`` mesh of 4 H100: what the row prints."""
    w = zoo.tiny("gpt", batch_size=8, loss=loss, **CONFIG)
    with torch.device("meta"):
        model, batch = w.build(), w.example_inputs()
    plan = torchalpa.plan(model, batch, w.loss_fn, cluster=torchalpa.Cluster.h100(1, 4),
                          method=torchalpa.ShardParallel(logical_mesh_shape=shape))
    strategies = json.loads(plan.to_json())["strategies"]
    logits = strategies.get("cross_entropy", {}).get("in", [None])[0]
    est = plan.estimates
    assert est.step_time_s is not None and est.memory_per_device_bytes is not None
    return {"mesh": "x".join(map(str, shape)), "loss": loss,
            "logits": "-" if logits is None else " ".join(logits),
            "step_ms": est.step_time_s * 1e3, "mib": est.memory_per_device_bytes / 2 ** 20,
            "digest": hashlib.sha256(json.dumps(strategies, sort_keys=True).encode())
            .hexdigest()[:12]}


def main() -> None:
    print(f"{'mesh':5} {'loss':6} {'fused loss logits':28} {'step ms':>8} {'MiB':>8}  digest")
    for shape in ((1, 4), (2, 2)):
        for loss in ("fused", "eager"):
            r = plan_row(shape, loss)
            print(f"{r['mesh']:5} {r['loss']:6} {r['logits']:28} {r['step_ms']:8.3f} "
                  f"{r['mib']:8.1f}  {r['digest']}", flush=True)


if __name__ == "__main__":
    main()
