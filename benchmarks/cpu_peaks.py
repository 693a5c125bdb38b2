"""Peak memory of a training step on CPU: eager PyTorch, torchalpa's ``train_step`` and
the README's loop (``loss = pmodel(x, y); loss.backward()``), beside the plan's estimate.

    python benchmarks/cpu_peaks.py                       # every model, fp32
    python benchmarks/cpu_peaks.py --models resnet --dtype bf16

Small zoo models (widths of 16-128, a few layers, batches of 8-16) so that a CPU steps them
in seconds. Each variant builds its model and runs 3 steps (AdamW) under the profiler; its
peak is the CPU allocator's (``runtime/measurement/allocated.py``), everything the variant
allocated counted, as ``torch.cuda.max_memory_allocated`` counts it on a GPU; every variant
runs in a process of its own. ``bf16`` is
eager under CPU autocast and torchalpa with ``MixedPrecision(param_dtype=torch.bfloat16)``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.runtime.measurement.allocated import peak_allocated

CONFIGS = {
    "resnet": (dict(widths=(16, 32, 64, 128), blocks=(2, 2, 2, 2), image_size=64,
                    num_classes=100), 16),
    "bert": (dict(vocab_size=1000, max_seq_len=128, num_layers=2, hidden=128, num_heads=4,
                  intermediate=512, dropout=0.0), 8),
    "vit": (dict(image_size=64, patch_size=8, num_layers=2, hidden=128, num_heads=4,
                 num_classes=100, dropout=0.0), 8),
    "gpt": (dict(vocab_size=1000, max_seq_len=128, num_layers=2, num_heads=4, hidden=128,
                 dropout=0.0), 8),
}
MiB = 2**20


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def variants(w, batch, dtype: str):
    def eager():
        model = w.build()
        opt = adamw(model.parameters())
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss = w.loss_fn(model(*batch[:-1]), batch[-1])
            loss.backward()
            opt.step()

    def runtime(loop: str):
        def run():
            precision = torchalpa.MixedPrecision(param_dtype=torch.bfloat16) \
                if dtype == "bf16" else None
            pm = torchalpa.auto_parallel(w.build(), batch, w.loss_fn, optimizer=adamw,
                                         mixed_precision=precision)
            for _ in range(3):
                if loop == "train_step":
                    pm.train_step(*batch)
                else:
                    pm.optimizer.zero_grad(set_to_none=True)
                    pm(*batch).backward()
                    pm.optimizer.step()
            return pm.plan.estimates.memory_per_device_bytes
        return run
    return {"eager": eager, "train_step": runtime("train_step"),
            "loss.backward": runtime("loss.backward")}


def measure(w, label: str, dtype: str) -> dict:
    """Workload ``w``'s variant ``label`` in this process: its peak and the plan's estimate
    (None for eager)."""
    torch.manual_seed(0)
    batch = w.example_inputs()
    measured = peak_allocated(variants(w, batch, dtype)[label])
    return {"peak": measured.peak, "plan": measured.result}


def in_own_process(script: str, *args: str) -> dict | str:
    """Run ``script --one ARGS`` in a process of its own (its allocations are its own) and
    return the JSON line it prints last, or the end of its error output."""
    out = subprocess.run([sys.executable, os.path.abspath(script), "--one", *args],
                         capture_output=True, text=True)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode or not lines:
        return out.stderr.strip()[-300:]
    return json.loads(lines[-1])


def run_one(name: str, label: str, dtype: str) -> dict:
    """One variant of zoo model ``name`` in this process."""
    config, batch_size = CONFIGS[name]
    return measure(zoo.Workload(name, zoo.FAMILIES[name].tiny_config(**config), batch_size),
                   label, dtype)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)   # MODEL VARIANT: a JSON line
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one, args.dtype)))
        return
    print(f"{'model':<8}{'variant':<15}{'peak MiB':>10}{'plan MiB':>10}{'plan/peak':>10}"
          f"{'/ eager':>9}")
    for name in args.models:
        eager_peak = None
        for label in ("eager", "train_step", "loss.backward"):
            r = in_own_process(__file__, name, label, "--dtype", args.dtype)
            if isinstance(r, str):
                print(f"{name:<8}{label:<15}failed: {r[-200:]}")
                continue
            eager_peak = eager_peak or r["peak"]
            plan = r["plan"]
            cells = f"{plan / MiB:10.2f}{plan / r['peak']:10.2f}" if plan else " " * 20
            print(f"{name:<8}{label:<15}{r['peak'] / MiB:10.2f}{cells}"
                  f"{r['peak'] / eager_peak:9.2f}", flush=True)


if __name__ == "__main__":
    main()
