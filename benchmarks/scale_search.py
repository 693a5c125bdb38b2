"""One pipeline candidate of targets e and f at a reduced layer count: where the pipeline
search's time goes as the cluster grows (layer ILPs, stage DP, exact stage solves).

    python benchmarks/scale_search.py --model 70b --layers 8 --nodes 16
    python benchmarks/scale_search.py --model 70b --layers 8 --nodes 16 --step-classes

Plans LLaMA-3-70B (or 3.1-405B) cut to ``--layers`` decoder layers, bf16, batch 128 x 8192
(405B: 64 x 8192) on ``--nodes`` x 8 H100 with ``AutoParallel(num_micro_batches=...,
remat="none")``: one candidate, the one targets e and f try first. Prints the planned-in
time, the search's own split (``plan.summary()``'s AutoParallel note), the layer ILPs, the
views priced from their class's plan, the exact stage solves and the estimate.
``--step-classes`` groups views by every dim of the step (the search before), not each
layer's own (``PassSwitches.layer_classes`` off); ``--price-all`` prices every view of a
class (``PassSwitches.copy_replicated`` off). The search logs one line per phase (layer ILPs,
stage DP and exact stage solves, the stages' own plans) on the ``torchalpa`` logger.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import AutoParallel
from torchalpa.core.switches import PassSwitches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["70b", "405b"], default="70b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=16)
    p.add_argument("--step-classes", action="store_true")
    p.add_argument("--price-all", action="store_true",
                   help="price every view, none given a replicated-alike view's estimates")
    args = p.parse_args()
    os.environ.setdefault("TORCHALPA_CACHE", "0")
    workload = (zoo.llama3_70b() if args.model == "70b" else zoo.llama3_405b()
                ).replace(num_layers=args.layers)
    with torch.device("meta"):
        model = workload.build()
    batch = workload.example_inputs(device="meta")
    method = AutoParallel(num_micro_batches=args.micro_batches, remat="none")
    start = time.perf_counter()
    with PassSwitches.using(layer_classes=not args.step_classes,
                            copy_replicated=not args.price_all):
        plan = torchalpa.plan(model, batch, workload.loss_fn,
                              cluster=torchalpa.Cluster.h100(num_nodes=args.nodes),
                              method=method,
                              mixed_precision=torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    seconds = time.perf_counter() - start
    cpu = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
              for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    e = plan.estimates
    print(f"{args.model} {args.layers} layers on {args.nodes} x 8, {args.micro_batches} "
          f"micro-batches, {'step' if args.step_classes else 'layer'} classes: planned in "
          f"{seconds:.1f} s (load {os.getloadavg()[0]:.1f}; CPU {cpu:.1f} s, its forked "
          f"workers included); layer ILPs {e.layer_solves}, "
          f"views priced from their class's plan {e.layers_repriced}, exact stage solves "
          f"{e.stage_solves}, pipeline search {e.search_seconds:.1f} s; est "
          f"{e.step_time_s!r} s/step, {len(plan.stages)} stages "
          f"{[list(s.submesh) for s in plan.stages]}", flush=True)
    for note in plan.notes:
        if note.startswith("AutoParallel planned in"):
            print("    " + note, flush=True)


if __name__ == "__main__":
    main()
