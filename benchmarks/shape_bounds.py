"""Each pipeline candidate's bounds, old and by its stages, against a plan's estimate:
``OMP_NUM_THREADS=1 python benchmarks/shape_bounds.py g [--best 83.09]``.

For target g (GPT-39B, batch 1024 x 1024, 8 x 8 H100, defaults) or e (LLaMA-3-70B bf16,
16 x 8 H100), lists AutoParallel's candidates as its search orders them
(``torchalpa.parallel.auto``) with the bound it refuses them by before this change
(``bounds.StepProfile``: every op at its roofline over every device) and the stage bound
(``passes/pipeline_search/shape_bound.py``: fill and drain of any cut, launches, floors and
host time per stage, states per stage), each derived from the candidate's own capture
(the step at its micro-batch count and checkpointing). ``--best``: a plan's estimate
(s/step) to print each bound's ratio to; a candidate whose bound times one plus the
tolerance is at least that estimate is refused by it. Nothing is solved: capture and
bounds only (a minute or two for g).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TORCHALPA_CACHE", "0")

import torch  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402
from torchalpa.core.calls import CallSignature  # noqa: E402
from torchalpa.parallel.auto import AutoResolver, SearchSession  # noqa: E402

TARGETS = {
    "g": (zoo.gpt_39b, lambda: torchalpa.Cluster.h100(num_nodes=8), False),
    "e": (zoo.llama3_70b, lambda: torchalpa.Cluster.h100(num_nodes=16), True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", choices=sorted(TARGETS))
    p.add_argument("--best", type=float, default=None, help="a plan's estimate, s/step")
    args = p.parse_args()
    build, make_cluster, bf16 = TARGETS[args.target]
    workload = build()
    with torch.device("meta"):
        model = workload.build()
    if bf16:
        from torchalpa.parallel.workflow import with_precision
        model = with_precision(model, torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    batch = workload.example_inputs(device="meta")
    cluster = make_cluster()
    method = torchalpa.AutoParallel()
    target = AutoResolver().target(method, cluster=cluster, mesh=None,
                                   world=cluster.num_devices, live=False)
    signature, tensors = CallSignature.of(batch)
    session = SearchSession(model, tensors, workload.loss_fn, method=method,
                            cluster=target.cluster, meshes=target.meshes,
                            allow_pipeline=target.allow_pipeline, signature=signature)
    search = session._search
    start = time.perf_counter()
    candidates, refused = search.candidates()
    print(f"{len(candidates)} candidates, {len(refused)} refused by memory "
          f"({time.perf_counter() - start:.1f} s)")
    tol = method.tolerance
    header = f"{'candidate':<44} {'old bound':>10} {'stage bound':>12} {'gain':>7}"
    print(header + (f" {'old/best':>9} {'new/best':>9}" if args.best else ""))
    counts = [0, 0]
    for c in candidates:
        exact = search.exact_candidate(c) if not c.exact else c
        t0 = time.perf_counter()
        new = search.stage_bound(exact) if exact.kind == "pipeline" else exact.bound_s
        line = (f"{exact.describe():<44} {exact.bound_s:>10.4f} {new:>12.4f} "
                f"{new / exact.bound_s - 1:>6.2%}")
        if args.best:
            line += f" {exact.bound_s / args.best:>9.4f} {new / args.best:>9.4f}"
            counts[0] += exact.bound_s * (1 + tol) >= args.best
            counts[1] += new * (1 + tol) >= args.best
        print(line + f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    if args.best:
        print(f"refused against {args.best:g} s/step (tolerance {tol:g}): old bound "
              f"{counts[0]}, stage bound {counts[1]} of {len(candidates)}")


if __name__ == "__main__":
    main()
