"""Capture LLaMA-2-13B's full training step (forward + backward + loss) on meta tensors.

Shapes from issue 3: hidden 5120, 40 layers, 40 heads, intermediate 13824, vocab 32000,
sequence 4096, batch 8. Prints the build and capture wall times, the OpGraph size and the
process's peak RSS, and fails (exit 1) with --check if capture takes more than 60 s or
the peak RSS exceeds 4 GB. ``--model`` captures the other big presets instead.

    python benchmarks/capture_llama13b.py [--check] [--layers N] [--profile out.prof]
                                          [--model llama2_13b|llama3_8b|gpt_39b]
"""

from __future__ import annotations

import argparse
import cProfile
import resource
import sys
import time

import torch

import torchalpa.models as models
from torchalpa.frontends.repeated import block_counts
from torchalpa.frontends.torch_export import capture

PRESETS = {"llama2_13b": models.llama2_13b, "llama3_8b": models.llama3_8b,
           "gpt_39b": models.gpt_39b}
MAX_SECONDS = 60.0
MAX_RSS_GB = 4.0


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9   # KiB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail above 60 s or 4 GB")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (profiling)")
    parser.add_argument("--profile", default=None, help="write a cProfile of the capture")
    parser.add_argument("--model", default="llama2_13b", choices=PRESETS)
    args = parser.parse_args()

    workload = PRESETS[args.model]()
    if args.layers is not None:
        workload = workload.replace(num_layers=args.layers)
    start = time.perf_counter()
    with torch.device("meta"):
        model = workload.build()
        batch = workload.example_inputs()
    built = time.perf_counter()
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    captured = capture(model, batch, workload.loss_fn)
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)
    done = time.perf_counter()

    graph = captured.graph
    seconds, rss = done - built, peak_rss_gb()
    print(f"{args.model} ({workload.config.num_layers} layers, batch {workload.batch_size}, "
          f"seq {workload.seq_len}) on meta")
    print(f"  build   {built - start:6.2f} s")
    print(f"  capture {seconds:6.2f} s  (forward + backward + loss -> OpGraph)")
    print(f"  peak RSS {rss:5.2f} GB")
    print(f"  {graph.summary()}")
    forward = sum(1 for n in graph.ops() if n.phase == "forward")
    print(f"  {forward} forward ops, {len(list(graph.ops())) - forward} backward ops, "
          f"{sum(n.flops for n in graph.ops()) / 1e15:.1f} PFLOP per step")
    print(f"  repeated blocks: {block_counts(graph.meta['repeated_blocks'])}")
    if args.check and (seconds > MAX_SECONDS or rss > MAX_RSS_GB):
        print(f"FAIL: limits are {MAX_SECONDS:.0f} s and {MAX_RSS_GB:.0f} GB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
