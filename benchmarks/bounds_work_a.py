"""Target a's LP bounds replayed, nothing solved: how many LPs, of what sizes, how many
simplex iterations, and how the CPU splits between building and solving them.

    OMP_NUM_THREADS=1 python benchmarks/bounds_work_a.py [--limit 6] [--profile out.prof]

LLaMA-3-8B bf16, batch 16 x 8192, 1 x 8 H100, AutoParallel's defaults (target a). The
search's own candidates in its own order (``_Search.solve_in_order`` replaced, as in
``relaxed_bounds_a.py``); for the first ``--limit`` checkpointing intra-op candidates,
every view's bound as ``relaxed_bound.views_bound`` computes it (nothing stops early).
Per LP it prints the view, columns, rows, nonzeros, HiGHS' simplex iterations, the
bound, a digest of the LP as HiGHS got it (``lp_digest``: equal on two trees, the same
LP), and the CPU seconds of the whole bound against HiGHS' ``run`` alone; the sums at
the end are the work figures (LPs, iterations) that do not depend on the load, and the
cyclic garbage collector's share of the CPU. With
``BOUNDS_DUMP=<dir>`` each LP is also written there as ``lp<i>.mps`` (to weigh HiGHS'
options on them).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import os
import time

os.environ["TORCHALPA_CACHE"] = "0"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402
from torchalpa.parallel import auto  # noqa: E402
from torchalpa.parallel.shard import blocks_of  # noqa: E402
from torchalpa.passes.sharding.intra_op import step_time_lower_bound  # noqa: E402

LPS: list[dict] = []
COLLECTOR = {"s": 0.0, "runs": 0, "since": 0.0}
"""CPU seconds of the cyclic garbage collector's runs while bounds are computed."""


def _collector_timed(phase: str, info: dict) -> None:
    """A ``gc.callbacks`` entry summing the collector's CPU seconds."""
    if phase == "start":
        COLLECTOR["since"] = time.process_time()
    else:
        COLLECTOR["s"] += time.process_time() - COLLECTOR["since"]
        COLLECTOR["runs"] += 1


def lp_digest(lp) -> str:
    """A digest of everything HiGHS was given: the columns' names, costs and bounds, the
    rows' bounds and the matrix, to tell two trees' LPs equal."""
    h = hashlib.sha256()
    for part in (lp.col_cost_, lp.col_lower_, lp.col_upper_, lp.row_lower_, lp.row_upper_,
                 lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_):
        h.update(np.asarray(part).tobytes())
    h.update("\n".join(lp.col_names_).encode())
    return h.hexdigest()[:16]


def _counted_run(run):
    """``highspy.Highs.run`` that records the model's size, iterations and CPU seconds."""
    def counted(h):
        if os.environ.get("BOUNDS_DUMP"):
            h.writeModel(f"{os.environ['BOUNDS_DUMP']}/lp{len(LPS)}.mps")
        start = time.process_time()
        status = run(h)
        run_s = time.process_time() - start
        lp = h.getLp()
        LPS.append({"cols": lp.num_col_, "rows": lp.num_row_, "nnz": len(lp.a_matrix_.index_),
                    "iterations": h.getInfo().simplex_iteration_count,
                    "run_s": run_s, "digest": lp_digest(lp),
                    "probe_s": time.process_time() - start - run_s})
        return status
    return counted


def _views(search, c) -> str:
    graph = search.capture(c.num_micro_batches, c.remat, c.regather).graph
    method, out = search.intra_op_method(c), []
    for mesh in search.meshes:
        start, before = time.process_time(), len(LPS)
        bound = step_time_lower_bound(graph, mesh, method, inputs=search.inputs,
                                      memo=search.pricing, blocks=blocks_of(graph))
        lp = LPS[-1] if len(LPS) > before else {}
        spent = time.process_time() - start - lp.get("probe_s", 0.0)   # the digest's left out
        out.append(f"{'x'.join(map(str, mesh.shape))}: {bound:.6f} ({spent:.2f} s, HiGHS "
                   f"{lp.get('run_s', 0):.2f} s, {lp.get('iterations')} it, "
                   f"{lp.get('cols')} x {lp.get('rows')}, nnz {lp.get('nnz')}, "
                   f"LP {lp.get('digest')})")
        if lp:
            lp["total_s"] = spent
    return "; ".join(out)


def probe(limit: int, profiler):
    def bounded(search, candidates) -> None:
        candidates, i, done = list(candidates), -1, 0
        while i + 1 < len(candidates) and done < limit:
            i += 1
            c = candidates[i]
            if not c.exact:
                search.requeue_exact(candidates, i)
            elif c.kind == "intra-op" and c.remat != "none":
                graph = search.capture(c.num_micro_batches, c.remat, c.regather).graph
                blocks_of(graph)
                profiler.enable()
                gc.callbacks.append(_collector_timed)
                text = _views(search, c)
                gc.callbacks.remove(_collector_timed)
                profiler.disable()
                print(f"{c.describe()} | {text}", flush=True)
                done += 1
        total = sum(lp.get("total_s", 0) for lp in LPS)
        run = sum(lp["run_s"] for lp in LPS)
        print(f"{len(LPS)} LPs, {sum(lp['iterations'] for lp in LPS)} simplex iterations, "
              f"CPU {total:.1f} s of which HiGHS run {run:.1f} s, the garbage collector "
              f"{COLLECTOR['s']:.1f} s in {COLLECTOR['runs']} runs", flush=True)
        raise SystemExit(0)
    return bounded


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--profile", default=None)
    args = p.parse_args()
    import highspy
    highspy.Highs.run = _counted_run(highspy.Highs.run)  # type: ignore[method-assign]
    profiler = cProfile.Profile(time.process_time)     # CPU seconds, not the loaded wall
    auto._Search.solve_in_order = probe(args.limit, profiler)  # type: ignore[method-assign]
    w = zoo.llama3_8b()
    with torch.device("meta"):
        model = w.build()
    try:
        torchalpa.plan(model, w.example_inputs(device="meta"), w.loss_fn,
                       cluster=torchalpa.Cluster.h100(1, 8),
                       mixed_precision=torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    finally:
        if args.profile:
            profiler.dump_stats(args.profile)


if __name__ == "__main__":
    main()
