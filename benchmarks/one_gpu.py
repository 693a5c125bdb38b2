"""Step time and peak memory on one GPU: eager PyTorch, torch.compile, torchalpa and
torchalpa with ``compile=True``, per model and dtype, next to the plan's estimates.

    python benchmarks/one_gpu.py                          # every model, fp32 and bf16
    python benchmarks/one_gpu.py --models gpt2 --dtypes bf16 --steps 20

Models (zoo configs at real widths, dropout off): ``gpt2`` (GPT-2 small, seq 1024),
``gpt_small`` (4 layers of 256, seq 256, batch 8: per-op overheads dominate), ``llama1b``
(LLaMA, 16 layers of 2048, GQA 32/8 heads, seq 1024), ``bert`` (BERT-base, seq 512),
``vit`` (ViT-B/16, 224 px). ``bf16`` is eager under ``torch.autocast`` and torchalpa
with ``MixedPrecision(param_dtype=torch.bfloat16)``; ``fp32`` leaves TF32 off (PyTorch's
default). AdamW everywhere. Each variant runs alone (its model built, warmed
up, timed, freed), so its peak memory is its own; step times are medians over ``--steps``
synchronized steps. The plan's estimates (step time, memory per device) are what the
planner predicted for the same step on the detected GPU (``Cluster.detect()``).

Needs CUDA; without it the script says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import torchalpa
import torchalpa.models as zoo


@dataclass(frozen=True)
class Bench:
    family: str
    config: dict
    batch_size: int
    seq_len: int | None = None


BENCHES = {
    "gpt2": Bench("gpt", dict(vocab_size=50257, max_seq_len=1024, num_layers=12, num_heads=12,
                              hidden=768, dropout=0.0), 8),
    # issue 19's small model: launch-bound, where per-op overheads show
    "gpt_small": Bench("gpt", dict(vocab_size=50257, max_seq_len=256, num_layers=4, num_heads=4,
                                   hidden=256, dropout=0.0), 8),
    "llama1b": Bench("llama", dict(vocab_size=32000, max_seq_len=1024, num_layers=16,
                                   hidden=2048, num_heads=32, num_kv_heads=8,
                                   intermediate=5632), 4),
    "bert": Bench("bert", dict(vocab_size=30522, max_seq_len=512, num_layers=12, hidden=768,
                               num_heads=12, intermediate=3072, dropout=0.0), 16),
    "vit": Bench("vit", dict(image_size=224, patch_size=16, num_layers=12, hidden=768,
                             num_heads=12, num_classes=1000, dropout=0.0), 32),
}
DTYPES = ("fp32", "bf16")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=list(BENCHES), choices=list(BENCHES))
    p.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation) first")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    return p.parse_args()


def workload(bench: Bench):
    config = zoo.FAMILIES[bench.family].tiny_config(**bench.config)
    return zoo.Workload(bench.family, config, bench.batch_size, bench.seq_len)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def eager_variant(w, batch, dtype: str, compiled: bool) -> Callable[[], object]:
    model = w.build().cuda()
    opt = adamw(model.parameters())
    forward = torch.compile(model) if compiled else model

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = w.loss_fn(forward(*batch[:-1]), batch[-1])
        loss.backward()
        opt.step()
        return loss
    return step, None


def torchalpa_variant(w, batch, dtype: str, compiled: bool):
    model = w.build().cuda()
    precision = torchalpa.MixedPrecision(param_dtype=torch.bfloat16) if dtype == "bf16" else None
    pm = torchalpa.auto_parallel(model, batch, w.loss_fn, optimizer=adamw,
                                 mixed_precision=precision, compile=compiled)
    return (lambda: pm.train_step(*batch)), pm.plan


VARIANTS = {
    "eager": lambda w, b, d: eager_variant(w, b, d, False),
    "torch.compile": lambda w, b, d: eager_variant(w, b, d, True),
    "torchalpa": lambda w, b, d: torchalpa_variant(w, b, d, False),
    "torchalpa compile=True": lambda w, b, d: torchalpa_variant(w, b, d, True),
}


def measure(make_step, steps: int, warmup: int) -> dict:
    """Median step seconds and peak allocated bytes of one variant, built alone."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step, plan = make_step()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    result = {"step_s": statistics.median(times), "peak_bytes": torch.cuda.max_memory_allocated()}
    if plan is not None:
        result["plan_step_s"] = plan.estimates.get("step_time_s")
        result["plan_memory_bytes"] = plan.estimates.get("memory_per_device_bytes")
    del step, plan
    return result


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/one_gpu.py needs a CUDA device, and torch.cuda.is_available() is False "
              f"here (PyTorch {torch.__version__}). Run it on a GPU machine: "
              "make bench-gpu (see ../shared/tools/gpu_wheels.sh).", file=sys.stderr)
        sys.exit(2)
    cluster = torchalpa.Cluster.detect(1, 1)
    print(f"{torch.cuda.get_device_name()} ({cluster.name}), PyTorch {torch.__version__}; "
          f"planned with {cluster.memory_per_device / 2**30:.1f} GiB usable; "
          f"median of {args.steps} steps after {args.warmup} warm-up, AdamW")
    variants = {k: v for k, v in VARIANTS.items() if not (args.no_compile and "compile" in k)}
    for name in args.models:
        bench = BENCHES[name]
        w = workload(bench)
        torch.manual_seed(0)
        batch = tuple(x.cuda() for x in w.example_inputs())
        for dtype in args.dtypes:
            print(f"\n{name} ({bench.family}, batch {bench.batch_size}), {dtype}")
            print(f"  {'variant':<24}{'step ms':>10}{'peak GiB':>10}"
                  f"{'plan ms':>10}{'plan GiB':>10}")
            for label, make in variants.items():
                try:
                    r = measure(lambda: make(w, batch, dtype), args.steps, args.warmup)
                except Exception as e:  # report and go on: one failure should not hide the rest
                    print(f"  {label:<24}failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    continue
                plan_ms = f"{r['plan_step_s'] * 1e3:10.1f}" if r.get("plan_step_s") else " " * 10
                plan_gib = (f"{r['plan_memory_bytes'] / 2**30:10.2f}"
                            if r.get("plan_memory_bytes") else "")
                print(f"  {label:<24}{r['step_s'] * 1e3:10.1f}{r['peak_bytes'] / 2**30:10.2f}"
                      f"{plan_ms}{plan_gib}")


if __name__ == "__main__":
    main()
