"""Launched by tests/test_generate.py: a zoo Llama built on ``meta``, planned for
generation with every weight split over the ranks, filled from a sharded safetensors
snapshot (``model.safetensors.index.json`` and its files, as ``from_pretrained`` lays
them out) by ``load_pretrained``; each rank reports what it read and its peak host memory,
then generates beside HuggingFace's ``generate()`` on the twin of the whole model.

    load_worker.py OUT SNAPSHOT_DIR HIDDEN LAYERS

Rank 0 writes the snapshot first (from a model built with seed 0, in several files).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from worker_io import attempt, finish  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.models import Llama, LlamaConfig  # noqa: E402
from torchalpa.runtime.execution.mesh import init_distributed  # noqa: E402
from torchalpa.runtime.measurement.host_memory import rss_bytes  # noqa: E402


def config(hidden: int, layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=4096, max_seq_len=64, num_layers=layers, hidden=hidden,
                       num_heads=8, num_kv_heads=8, intermediate=2 * hidden)


def write_snapshot(directory: str, c: LlamaConfig, num_files: int = 4) -> int:
    """The model of seed 0 as a sharded snapshot; returns its bytes."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    model = Llama(c)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = list(state)
    os.makedirs(directory, exist_ok=True)
    weight_map = {}
    for i in range(num_files):
        part = names[i::num_files]
        file = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        save_file({k: state[k] for k in part}, os.path.join(directory, file))
        weight_map.update({k: file for k in part})
    total = sum(v.numel() * v.element_size() for v in state.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def run(directory: str, hidden: int, layers: int) -> dict:
    c = config(hidden, layers)
    if dist.get_rank() == 0:
        write_snapshot(directory, c)
    dist.barrier()
    with torch.device("meta"):
        model = Llama(c)
    torch.manual_seed(1)                       # the same prompts on every rank
    ids = torch.randint(3, 4096, (2, 8))
    method = torchalpa.ShardParallel(auto_sharding_option=torchalpa.AutoShardingOption(
        parameters="sharded"))                 # every weight split over the ranks
    pm = torchalpa.auto_parallel(model, ids, mode=torchalpa.Inference(max_context=32),
                                 method=method, init_weights=lambda m: None)
    share = sum(p.to_local().numel() * p.element_size() for p in pm.module.parameters())
    rss_built = rss_bytes()
    info = torchalpa.load_pretrained(pm, directory)
    report = pm.last_load
    got = pm.generate(ids, max_new_tokens=6)
    # the reference: the whole model, after the measurement, from the same files
    from safetensors.torch import load_file

    from torchalpa.models.hf_twins import hf_twin
    whole = Llama(c)
    state = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            state.update(load_file(os.path.join(directory, file)))
    whole.load_state_dict(state)
    expected = hf_twin(whole).eval().generate(ids, max_new_tokens=6, pad_token_id=0)
    return {"info": info, "share_bytes": share, "rss_built": rss_built,
            "bytes_read": report.bytes_read, "snapshot_bytes": report.snapshot_bytes,
            "files": report.files, "rss_before": report.rss_before_bytes,
            "peak_rss": report.peak_rss_bytes, "report": str(report),
            "tokens": got.tolist(), "expected": expected.tolist()}


def main() -> None:
    out, directory, hidden, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    init_distributed()
    result = attempt(lambda: run(directory, hidden, layers))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    finish({"ranks": everyone}, out)


if __name__ == "__main__":
    main()
