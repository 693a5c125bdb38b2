"""Memory of plain tensor parallelism against Megatron's sequence parallelism, planned.

A zoo GPT on one node of H100s, the tensor-parallel mesh over all of them, Megatron's
column / row styles pinned on the attention and MLP products; planned twice, plain and
with ``AutoShardingOption(sequence_parallel=True)`` (norms, and what the ILP puts beside
them, split by sequence), each with activation checkpointing 'none' and 'full'. Prints the
estimated step, memory per device and saved activations per device of each, and the
ratios. Usage: ``python benchmarks/seq_parallel.py [--layers 8 --hidden 1024 --seq 2048
--tp 4 --dropout 0]``.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import torchalpa
from torchalpa.models import gpt

STYLES = {"h.*.attn.c_attn": ColwiseParallel(), "h.*.attn.c_proj": RowwiseParallel(),
          "h.*.mlp.c_fc": ColwiseParallel(), "h.*.mlp.c_proj": RowwiseParallel()}


def plan(model, batch, tp: int, **option):
    opt = torchalpa.AutoShardingOption(pin=STYLES, **option)
    return torchalpa.plan(model, batch, gpt.loss_fn,
                          cluster=torchalpa.Cluster.h100(devices_per_node=tp),
                          method=torchalpa.ShardParallel(logical_mesh_shape=(tp,),
                                                         auto_sharding_option=opt))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.0)
    a = ap.parse_args()
    config = gpt.GPTConfig(vocab_size=50304, max_seq_len=a.seq, num_layers=a.layers,
                           num_heads=a.heads, hidden=a.hidden, dropout=a.dropout)
    torch.manual_seed(0)
    model, batch = gpt.GPT(config), gpt.example_batch(config, a.batch, seq_len=a.seq)
    print(f"GPT {a.layers} layers, hidden {a.hidden}, seq {a.seq}, batch {a.batch}, "
          f"dropout {a.dropout}; tp {a.tp} H100s")
    print("| remat | plan | step ms | memory/device MiB | saved activations MiB |")
    print("|---|---|---|---|---|")
    for remat in ("none", "full"):
        rows = {}
        for name, sp in (("plain TP", False), ("sequence parallel", True)):
            start = time.perf_counter()
            e = plan(model, batch, a.tp, remat=remat, sequence_parallel=sp).estimates
            rows[name] = e
            print(f"| {remat} | {name} | {e.step_time_s * 1e3:.2f} | "
                  f"{e.memory_per_device_bytes / 2**20:.1f} | "
                  f"{e.saved_activation_bytes_per_device / 2**20:.1f} |  "
                  f"(planned in {time.perf_counter() - start:.0f} s)", flush=True)
        tp, sp = rows["plain TP"], rows["sequence parallel"]
        print(f"| {remat} | SP / TP | {sp.step_time_s / tp.step_time_s:.3f} | "
              f"{sp.memory_per_device_bytes / tp.memory_per_device_bytes:.3f} | "
              f"{sp.saved_activation_bytes_per_device / tp.saved_activation_bytes_per_device:.3f} |")


if __name__ == "__main__":
    main()
