"""What a micro-batch capture costs: traced again (before) or derived from the whole
batch's capture (``frontends/rebatch.py``, what ``AutoParallel``'s search does for every
count after the first, which it traces and derives both to check the derivation).

LLaMA-3-8B bf16 on meta tensors, batch 16 x 8192 (target a of ``auto_targets.py``): the
whole batch is captured once (the search's first capture, for its bounds); then the step
of ``1/k`` of the batch is traced as before and derived as now, each timed, and the two
compared (the same OpGraph nodes, graph meta and generated code, or exit 1). Prints the
seconds (wall and this process's CPU), the ratios and the load; timings on a shared machine are noisy, the ratio within
one run less so.

    python benchmarks/capture_time.py [--layers N] [--k 2 4] [--model llama3_8b|gpt_39b]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.frontends.rebatch import rebatched_capture, same_step
from torchalpa.parallel.workflow import capture_examples, capture_step, with_precision


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="fewer layers")
    parser.add_argument("--k", type=int, nargs="+", default=[2], help="micro-batch counts")
    parser.add_argument("--model", default="llama3_8b", choices=["llama3_8b", "gpt_39b"])
    args = parser.parse_args()
    workload = getattr(zoo, args.model)()
    if args.layers is not None:
        workload = workload.replace(num_layers=args.layers)
    with torch.device("meta"):
        model = with_precision(workload.build(),
                               torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    batch = workload.example_inputs(device="meta")
    start = time.perf_counter()
    whole = capture_step(model, capture_examples(model, batch, 1), workload.loss_fn)
    first = time.perf_counter() - start
    print(f"{args.model} ({workload.config.num_layers} layers), batch "
          f"{'x'.join(map(str, batch[0].shape))}, bf16, load {os.getloadavg()[0]:.1f}")
    print(f"  whole batch traced: {first:.2f} s ({len(whole.graph)} nodes)")
    failed = False
    for k in args.k:
        start, cpu = time.perf_counter(), time.process_time()
        traced = capture_step(model, capture_examples(model, batch, k), workload.loss_fn)
        before, before_cpu = time.perf_counter() - start, time.process_time() - cpu
        start, cpu = time.perf_counter(), time.process_time()
        derived = rebatched_capture(whole, k)
        after, after_cpu = time.perf_counter() - start, time.process_time() - cpu
        if derived is None:
            print(f"  k={k}: not derived (traced again, {before:.2f} s)")
            failed = True
            continue
        same = same_step(derived, traced)
        failed |= not same
        print(f"  k={k}: traced {before:.2f} s ({before_cpu:.2f} s CPU), derived {after:.2f} s "
              f"({after_cpu:.2f} s CPU), ratio {before / after:.1f}x ({before_cpu / after_cpu:.1f}x "
              f"CPU); the same graph: {same}")
    print(f"  load after {os.getloadavg()[0]:.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
