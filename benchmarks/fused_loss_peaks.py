"""Peak memory of a small GPT's training step on CPU with eager's cross-entropy and with the
fused ``torchalpa::cross_entropy`` (``GPTConfig.loss``), beside the plan's estimate.

    OMP_NUM_THREADS=1 TORCHALPA_CACHE=0 python benchmarks/fused_loss_peaks.py [--dtype bf16]

A GPT whose head is most of its activations (vocabulary 8192, width 64, 2 blocks, 8 x 128
tokens: one float32 tokens x vocabulary tensor is 32 MiB), 3 AdamW steps per variant:
PyTorch eager (the same model and loss, under CPU autocast for bf16) and torchalpa's
``train_step`` on one device, with eager's loss and with the fused one. Each variant runs
in a process of its own (``cpu_peaks.py --one``'s way), the two losses alternating, and
the table prints each peak (the CPU allocator's, ``runtime/measurement/allocated.py``),
the plan's estimate, and fused / eager of the same variant.
"""

from __future__ import annotations

import argparse
import json

from cpu_peaks import MiB, in_own_process, measure

import torchalpa.models as zoo

CONFIG = dict(vocab_size=8192, max_seq_len=128, num_layers=2, num_heads=4, hidden=64,
              dropout=0.0)
BATCH = 8
LOSSES = ("eager", "fused")
LABELS = ("eager", "train_step")


def run_one(loss: str, label: str, dtype: str) -> dict:
    """One variant with loss ``loss`` in this process."""
    return measure(zoo.Workload("gpt", zoo.GPTConfig(**CONFIG, loss=loss), BATCH), label,
                   dtype)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)   # LOSS VARIANT: a JSON line
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one, args.dtype)))
        return
    one = BATCH * CONFIG["max_seq_len"] * CONFIG["vocab_size"] * 4
    print(f"GPT {CONFIG}, batch {BATCH}, {args.dtype}; one float32 tokens x vocabulary "
          f"tensor: {one / MiB:.0f} MiB")
    print(f"{'variant':<12}{'loss':<7}{'peak MiB':>10}{'plan MiB':>10}{'plan/peak':>10}"
          f"{'fused/eager':>12}")
    for label in LABELS:
        peaks = {}
        for loss in LOSSES:
            r = in_own_process(__file__, loss, label, "--dtype", args.dtype)
            if isinstance(r, str):
                print(f"{label:<12}{loss:<7}failed: {r}")
                continue
            peaks[loss] = r["peak"]
            plan = r["plan"]
            cells = f"{plan / MiB:10.2f}{plan / r['peak']:10.2f}" if plan else " " * 20
            ratio = f"{r['peak'] / peaks['eager']:12.2f}" if "eager" in peaks else ""
            print(f"{label:<12}{loss:<7}{r['peak'] / MiB:10.2f}{cells}{ratio}", flush=True)


if __name__ == "__main__":
    main()
