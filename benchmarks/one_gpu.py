"""Step time and peak memory on one GPU, measured beside the plan's estimates: eager
PyTorch, torch.compile, torchalpa and torchalpa with ``compile=True``, per zoo model and
dtype.

    python benchmarks/one_gpu.py                          # every model, fp32 and bf16
    python benchmarks/one_gpu.py --models gpt2 --dtypes bf16 --steps 20
    python benchmarks/one_gpu.py --estimates-only --cluster h200    # no GPU needed
    python benchmarks/one_gpu.py --estimates-only --against LOG...  # beside a GPU run's steps

Models (zoo configs at real widths, dropout off): ``gpt2`` (GPT-2 small, seq 1024, batch
16), ``gpt_small`` (4 layers of 256, seq 256, batch 8: per-op overheads dominate),
``llama1b`` (LLaMA, 16 layers of 2048, GQA 32/8 heads, seq 2048, batch 4), ``bert``
(BERT-base, seq 512, batch 16), ``vit`` (ViT-B/16, 224 px, batch 32), ``resnet``
(ResNet-34: basic blocks 3, 4, 6, 3; 224 px, batch 64), ``moe`` (8 layers of 1024, 8
experts top-2, seq 1024, batch 8).
``bf16`` is eager under ``torch.autocast`` and torchalpa with
``MixedPrecision(param_dtype=torch.bfloat16)``; ``fp32`` leaves TF32 off (PyTorch's
default). AdamW (fused) everywhere.

Every variant runs in a process of its own (this script, ``--one``): its peak memory is its
own (``torch.compile`` keeps its model alive in dynamo's caches, and the caching allocator
its blocks); step times are medians over ``--steps`` synchronized steps after
``--warmup``. With ``--jobs N`` up to N variant processes run at once, but only one at a
time holds the GPU for its warm-up and timed steps (a file lock): the others build, capture
and plan meanwhile, which is most of a variant's wall time. The torchalpa rows print the
plan's estimates (step time, memory per device) for the same step on the detected GPU
(``Cluster.detect()``, with the profile of ``torchalpa calibrate`` if one is stored), and
estimate / measured. ``--estimates-only``
plans every model for one GPU of a preset (``--cluster``) on the meta device and prints
the estimates alone: the rows a GPU run then fills in.

Without CUDA (and without ``--estimates-only``) the script says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
                              hidden=768, dropout=0.0), 16),
    # issue 19's small model: launch-bound, where per-op overheads show
    "gpt_small": Bench("gpt", dict(vocab_size=50257, max_seq_len=256, num_layers=4, num_heads=4,
                                   hidden=256, dropout=0.0), 8),
    "llama1b": Bench("llama", dict(vocab_size=32000, max_seq_len=2048, num_layers=16,
                                   hidden=2048, num_heads=32, num_kv_heads=8,
                                   intermediate=5632), 4),
    "bert": Bench("bert", dict(vocab_size=30522, max_seq_len=512, num_layers=12, hidden=768,
                               num_heads=12, intermediate=3072, dropout=0.0), 16),
    "vit": Bench("vit", dict(image_size=224, patch_size=16, num_layers=12, hidden=768,
                             num_heads=12, num_classes=1000, dropout=0.0), 32),
    "resnet": Bench("resnet", dict(widths=(64, 128, 256, 512), blocks=(3, 4, 6, 3),
                                   image_size=224, num_classes=1000), 64),
    "moe": Bench("moe", dict(vocab_size=32000, max_seq_len=1024, num_layers=8, hidden=1024,
                             num_heads=16, intermediate=4096, num_experts=8, top_k=2), 8),
}
DTYPES = ("fp32", "bf16")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=list(BENCHES), choices=list(BENCHES))
    p.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation) first")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    p.add_argument("--jobs", type=int, default=1,
                   help="variant processes at once; one at a time holds the GPU for its timed "
                        "steps, the others build and plan meanwhile (default 1)")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS),
                   help="which variants to run (default: all)")
    p.add_argument("--estimates-only", action="store_true",
                   help="plan on the meta device for one GPU of --cluster; no GPU needed")
    p.add_argument("--cluster", default="h200", help="preset for --estimates-only")
    p.add_argument("--against", nargs="*", default=[], metavar="LOG",
                   help="with --estimates-only: logs of an earlier GPU run of this script; "
                        "prints the torchalpa variant's measured step and est/meas beside "
                        "each estimate")
    p.add_argument("--one", nargs=3, metavar=("MODEL", "DTYPE", "VARIANT"),
                   help=argparse.SUPPRESS)   # one variant, in this process: a JSON line
    return p.parse_args()


def workload(bench: Bench):
    config = zoo.FAMILIES[bench.family].tiny_config(**bench.config)
    return zoo.Workload(bench.family, config, bench.batch_size, bench.seq_len)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, fused=torch.cuda.is_available())


def eager_variant(w, batch, dtype: str, compiled: bool):
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


VARIANTS: dict[str, Callable] = {
    "eager": lambda w, b, d: eager_variant(w, b, d, False),
    "torch.compile": lambda w, b, d: eager_variant(w, b, d, True),
    "torchalpa": lambda w, b, d: torchalpa_variant(w, b, d, False),
    "torchalpa compile=True": lambda w, b, d: torchalpa_variant(w, b, d, True),
}


GPU_LOCK = "ONE_GPU_LOCK"   # the lock file's path, set by the parent when --jobs > 1


@contextlib.contextmanager
def gpu_turn():
    """Hold the GPU alone while timing: an exclusive lock on the file ``$ONE_GPU_LOCK``
    (nothing to hold when it is unset: one variant at a time)."""
    path = os.environ.get(GPU_LOCK)
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def measure(make_step, steps: int, warmup: int) -> dict:
    """Median step seconds and peak allocated bytes of one variant; the warm-up and timed
    steps run while this process holds the GPU alone (``gpu_turn``)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step, plan = make_step()
    with gpu_turn():
        return timed_steps(step, plan, steps, warmup)


def timed_steps(step, plan, steps: int, warmup: int) -> dict:
    """Run ``warmup`` steps, then time ``steps`` synchronized ones."""
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
        result["plan_step_s"] = plan.estimates.step_time_s
        result["plan_memory_bytes"] = plan.estimates.memory_per_device_bytes
    return result


def run_one(model: str, dtype: str, variant: str, steps: int, warmup: int) -> dict:
    """One variant in this process (``--one``): its measurement as a dict."""
    bench = BENCHES[model]
    w = workload(bench)
    torch.manual_seed(0)
    batch = tuple(x.cuda() for x in w.example_inputs())
    if dtype == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = False
    return measure(lambda: VARIANTS[variant](w, batch, dtype), steps, warmup)


def run_in_child(model: str, dtype: str, variant: str, args, env=None) -> dict:
    """``run_one`` in a fresh process: its memory figures are its own."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", model, dtype, variant,
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": tail[:200]}
    return json.loads(lines[-1])


def estimate(model: str, dtype: str, cluster) -> dict:
    """The plan's estimates for one GPU of ``cluster``, planned on the meta device."""
    from torchalpa.runtime.execution.precision import CastForward
    w = workload(BENCHES[model])
    with torch.device("meta"):
        net, batch = w.build(), w.example_inputs()
    if dtype == "bf16":
        net = CastForward(net, torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    plan = torchalpa.plan(net, batch, w.loss_fn, cluster=cluster)
    return {"plan_step_s": plan.estimates.step_time_s,
            "plan_memory_bytes": plan.estimates.memory_per_device_bytes,
            "host_s": plan.estimates.host_s or 0.0}


def measured_steps(paths: list[str]) -> dict[tuple[str, str], float]:
    """(model, dtype) -> the torchalpa variant's measured step seconds in logs this script
    printed on a GPU."""
    import re
    header, row = re.compile(r"^(\w+) \(batch \d+\), (\w+)$"), \
        re.compile(r"^\s+torchalpa\s+([\d.]+)\s")
    out: dict[tuple[str, str], float] = {}
    for path in paths:
        key = None
        with open(path) as f:
            for line in f:
                if m := header.match(line.strip()):
                    key = (m.group(1), m.group(2))
                elif (m := row.match(line)) and key is not None:
                    out[key] = float(m.group(1)) / 1e3
    return out


def print_estimates(args) -> None:
    """``--estimates-only``: every model planned for one GPU of ``--cluster``, beside the
    measured steps of ``--against`` logs where given."""
    cluster = torchalpa.Cluster.preset(args.cluster, 1, 1)
    measured = measured_steps(args.against)
    print(f"estimates for one {cluster.device_name} (measured: "
          f"{', '.join(args.against) or 'left for a GPU run, benchmarks/gpu_checks.sh'})")
    print(f"  {'model':<10}{'dtype':<6}{'batch':>6}{'plan ms':>10}{'host ms':>10}"
          f"{'plan GiB':>10}" + (f"{'meas ms':>10}{'est/meas':>10}" if measured else ""))
    for name in args.models:
        for dtype in args.dtypes:
            r = estimate(name, dtype, cluster)
            cells = ""
            if (name, dtype) in measured:
                m = measured[(name, dtype)]
                cells = f"{m * 1e3:>10.1f}{r['plan_step_s'] / m:>10.2f}"
            print(f"  {name:<10}{dtype:<6}{BENCHES[name].batch_size:>6}"
                  f"{r['plan_step_s'] * 1e3:>10.1f}{r['host_s'] * 1e3:>10.1f}"
                  f"{r['plan_memory_bytes'] / 2**30:>10.2f}{cells}", flush=True)


def main():
    args = parse_args()
    if args.one:
        model, dtype, variant = args.one
        print(json.dumps(run_one(model, dtype, variant, args.steps, args.warmup)))
        return
    if args.estimates_only:
        print_estimates(args)
        return
    if not torch.cuda.is_available():
        print("benchmarks/one_gpu.py needs a CUDA device, and torch.cuda.is_available() is False "
              f"here (PyTorch {torch.__version__}); --estimates-only prints the plans' side. "
              "Run it on a GPU machine: make bench-gpu (see ../shared/tools/gpu_wheels.sh).",
              file=sys.stderr)
        sys.exit(2)
    print(f"{torch.cuda.get_device_name()}, PyTorch {torch.__version__}; median of "
          f"{args.steps} steps after {args.warmup} warm-up, AdamW; one process per variant")
    measured_rows(args)


def row_cells(r: dict) -> str:
    """One variant's measured columns, and the plan's beside them where it has one."""
    cells = ""
    if r.get("plan_step_s"):
        cells = (f"{r['plan_step_s'] * 1e3:10.1f}{r['plan_memory_bytes'] / 2**30:10.2f}"
                 f"{r['plan_step_s'] / r['step_s']:10.2f}"
                 f"{r['plan_memory_bytes'] / r['peak_bytes']:9.2f}")
    return f"{r['step_s'] * 1e3:10.1f}{r['peak_bytes'] / 2**30:10.2f}{cells}"


def measured_rows(args) -> None:
    """Every (model, dtype, variant) in a child process, ``--jobs`` at once (the GPU held by
    one at a time while it times), printed in order as they finish."""
    variants = [k for k in args.variants if not (args.no_compile and "compile" in k)]
    runs = [(m, d, v) for m in args.models for d in args.dtypes for v in variants]
    env = None
    if args.jobs > 1:
        lock = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"one_gpu.{os.getpid()}.lock")
        env = dict(os.environ, **{GPU_LOCK: lock, "OMP_NUM_THREADS": "4"})
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_in_child, m, d, v, args, env) for m, d, v in runs]
        for (name, dtype, label), future in zip(runs, futures):
            if label == variants[0]:
                print(f"\n{name} (batch {BENCHES[name].batch_size}), {dtype}")
                print(f"  {'variant':<24}{'step ms':>10}{'peak GiB':>10}{'plan ms':>10}"
                      f"{'plan GiB':>10}{'est/meas':>10}{'mem e/m':>9}", flush=True)
            r = future.result()
            if "error" in r:
                print(f"  {label:<24}failed: {r['error']}", flush=True)
            else:
                print(f"  {label:<24}{row_cells(r)}", flush=True)


if __name__ == "__main__":
    main()
