"""Target a's intra-op candidates with their roofline bounds and each view's LP bound,
nothing solved: ``OMP_NUM_THREADS=1 python benchmarks/relaxed_bounds_a.py [--best 2.632]``.

LLaMA-3-8B bf16, batch 16 x 8192, 1 x 8 H100, AutoParallel's defaults (target a). The
search's own candidates in its own order (``_Search.solve_in_order`` replaced; each one
bounded by another mode's capture gets its own bounds first, as the search does), up to
the first whose roofline bound cannot beat ``--best`` (target a's plan, s/step) by more
than the tolerance. For each intra-op candidate: its roofline bound
(``passes/pricing/bounds.py``), its memory bound, and each view's
``step_time_lower_bound`` (blocks shared, the search's pricing memo) with the CPU seconds
it took -- the figures ``relaxed_bound.py`` refuses by (a candidate is refused where the
least of its views' bounds is at or above ``best / 1.01``). Compare with the estimates a
search's log gives (``TORCHALPA_LOG=info``).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["TORCHALPA_CACHE"] = "0"

import torch  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402
from torchalpa.parallel import auto  # noqa: E402
from torchalpa.parallel.shard import blocks_of  # noqa: E402
from torchalpa.passes.sharding.intra_op import step_time_lower_bound  # noqa: E402


def _views(search, c) -> str:
    graph = search.capture(c.num_micro_batches, c.remat, c.regather).graph
    method, out = search.intra_op_method(c), []
    for mesh in search.meshes:
        start = time.process_time()
        bound = step_time_lower_bound(graph, mesh, method, inputs=search.inputs,
                                      memo=search.pricing, blocks=blocks_of(graph))
        out.append(f"{'x'.join(map(str, mesh.shape))}: {bound:.4f} "
                   f"({time.process_time() - start:.1f} s)")
    return "; ".join(out)


def probe(best: float):
    def bounded(search, candidates) -> None:
        candidates, i = list(candidates), -1
        while i + 1 < len(candidates):
            i += 1
            c = candidates[i]
            if c.bound_s * (1 + search.method.tolerance) >= best:
                print(f"stop: {c.describe()}, bound {c.bound_s:.4f}", flush=True)
                break
            if not c.exact:
                search.requeue_exact(candidates, i)
            elif c.kind == "intra-op":
                print(f"{c.describe()}: bound {c.bound_s:.4f}, memory "
                      f"{c.memory_bound / 2 ** 30:.1f} GiB | {_views(search, c)}", flush=True)
        raise SystemExit(0)
    return bounded


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--best", type=float, default=2.632)
    args = p.parse_args()
    auto._Search.solve_in_order = probe(args.best)  # type: ignore[method-assign]
    w = zoo.llama3_8b()
    with torch.device("meta"):
        model = w.build()
    torchalpa.plan(model, w.example_inputs(device="meta"), w.loss_fn,
                   cluster=torchalpa.Cluster.h100(1, 8),
                   mixed_precision=torchalpa.MixedPrecision(param_dtype=torch.bfloat16))


if __name__ == "__main__":
    main()
