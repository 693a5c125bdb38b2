"""Where a bf16 step's time goes on one GPU: eager autocast vs torchalpa, side by side.

    python benchmarks/bf16_profile.py                       # bert, vit, gpt_small
    python benchmarks/bf16_profile.py --models bert --steps 5 --fp32

On one H200, BERT and ViT in bf16 ran 1.4-1.5x eager autocast while the same steps in
float32 ran within 6%; counted on a CPU, the two bf16 op streams launch about as many
kernels and move about as many bytes (tests/test_bf16_kernels.py). This script says what a
CPU cannot. For each variant (eager under ``torch.autocast(bfloat16)``; torchalpa with
``MixedPrecision(param_dtype=torch.bfloat16)``; ``--fp32`` adds both in float32) it prints:

- ``step ms``: median wall time of a synchronized step (as ``one_gpu.py``);
- ``issue ms``: median time until ``step()`` returns, before the synchronize: the host's
  own time to launch the step. ``issue`` close to ``step`` means the step is host-bound
  (the GPU waits for launches); much smaller means the GPU is the bottleneck;
- ``gpu ms``: the sum of the step's CUDA kernel times (torch.profiler, one step), and
  ``kernels``: how many it launched; ``step - gpu`` is time the GPU sat idle;
- ``syncs``: host-device synchronizations the profiler saw in the step (the blocking
  CUDA runtime calls of ``SYNC_CALLS``);
- then the ten kernels with the most GPU time, and the attention kernels by name (which
  fused SDPA backend ran, and how many times: on CUDA torchalpa's attention backward runs
  the forward again).

Models and configs are ``one_gpu.py``'s; each variant is built, warmed up, timed and freed
in turn, and each model's lines are printed as soon as it is done (a run cut short keeps
what it finished). Needs CUDA (exits 2 without it); about a minute per model on an H100.
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import one_gpu  # noqa: E402

SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize",
                        "cudaEventSynchronize", "cudaMemcpy"})   # cudaMemcpy: the blocking one
ATTENTION_WORDS = ("flash", "fmha", "attention", "efficient", "cudnn_sdpa")


def profile_step(step, steps: int, warmup: int) -> dict:
    """Step and issue times over ``steps`` steps, then one step under the profiler."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    walls, issues = [], []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
        issues.append(issued - start)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels: collections.Counter = collections.Counter()
    kernel_us: collections.Counter = collections.Counter()
    syncs: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += 1
            kernel_us[e.name] += e.device_time_total
        elif e.name in SYNC_CALLS:
            syncs[e.name] += 1
    syncs["cudaDeviceSynchronize"] -= 1      # torch.cuda.synchronize() after the step
    return {"step_ms": statistics.median(walls) * 1e3,
            "issue_ms": statistics.median(issues) * 1e3,
            "gpu_ms": sum(kernel_us.values()) / 1e3, "kernels": sum(kernels.values()),
            "syncs": {k: v for k, v in syncs.items() if v > 0},
            "top": kernel_us.most_common(10),
            "attention": {k: n for k, n in kernels.items()
                          if any(s in k.lower() for s in ATTENTION_WORDS)}}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["bert", "vit", "gpt_small"],
                   choices=list(one_gpu.BENCHES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fp32", action="store_true", help="also profile both in float32")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/bf16_profile.py needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    print(f"{torch.cuda.get_device_name()}, PyTorch {torch.__version__}; median of "
          f"{args.steps} steps after {args.warmup}, then one profiled step", flush=True)
    dtypes = ("bf16", "fp32") if args.fp32 else ("bf16",)
    for name in args.models:
        w = one_gpu.workload(one_gpu.BENCHES[name])
        torch.manual_seed(0)
        batch = tuple(x.cuda() for x in w.example_inputs())
        for dtype in dtypes:
            for label in ("eager", "torchalpa"):
                gc.collect()
                torch.cuda.empty_cache()
                step, _ = one_gpu.VARIANTS[label](w, batch, dtype)
                r = profile_step(step, args.steps, args.warmup)
                print(f"\n{name} {dtype} {label}: step {r['step_ms']:.1f} ms, issue "
                      f"{r['issue_ms']:.1f} ms, gpu {r['gpu_ms']:.1f} ms in {r['kernels']} "
                      f"kernels, syncs {r['syncs'] or 'none'}")
                print(f"  attention kernels: {r['attention'] or 'none'}")
                for k, us in r["top"]:
                    print(f"  {us / 1e3:8.2f} ms  {k[:110]}")
                sys.stdout.flush()
                del step


if __name__ == "__main__":
    main()
