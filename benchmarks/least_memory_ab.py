"""A near-budget view that does not fit, with its least memory said and unsaid, alternately:

    OMP_NUM_THREADS=1 python benchmarks/least_memory_ab.py [--layers 32] [--views 4x2]
        [--remat full:2] [--micro-batches 2] [--regather] [--rounds 1]

Target a's model (LLaMA-3-8B bf16, batch 16 x 8192, 1 x 8 H100) and one of its candidates
(default remat full:2, 2 micro-batches, parameters not gathered again, whose simplified
ILP and free followers' ILP both find no plan within the budget on the 2-D views), as the
search poses it: ``torchalpa.plan`` as ``auto_targets.py --targets a`` calls it, its
``_Search.solve_in_order`` replaced by this script (the search's own capture, views and
``intra_op_method``). Each view is planned as ``plan_intra_op`` plans it for a
ShardParallel user (the error says the least memory a plan needs: ``_minimum_memory``'s
ILPs) and as AutoParallel's search plans it (``least_memory_unsaid``: it does not), in
turn in this process, ``--rounds`` times. Prints each solve's CPU seconds
(``time.process_time``), HiGHS runs and their CPU seconds, the error's first line, and
per view the CPU ratio unsaid / said.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

os.environ["TORCHALPA_CACHE"] = "0"

from _planning import HIGHS, count_highs, target_a  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.parallel import auto  # noqa: E402
from torchalpa.parallel.shard import blocks_of  # noqa: E402
from torchalpa.passes.sharding import intra_op  # noqa: E402
from torchalpa.passes.sharding.ilp import InfeasibleError  # noqa: E402


class _Done(Exception):
    """Raised once the views are measured: the search goes no further."""


def _measure(args):
    """``_Search.solve_in_order``'s stand-in: the A/B on the candidate's views."""
    want = (args.remat, args.micro_batches, args.regather)

    def measure(search, candidates):
        c = next(c for c in candidates if (c.remat, c.num_micro_batches, c.regather) == want)
        c = c if c.exact else search.exact_candidate(c)
        search.gap = search.search_gap()      # as the search solves it: within its tolerance
        graph = search.capture(c.num_micro_batches, c.remat, c.regather).graph
        method, blocks = search.intra_op_method(c), blocks_of(graph)
        for view in args.views:
            mesh = next(m for m in search.meshes if "x".join(map(str, m.shape)) == view)
            seen: dict[str, list[float]] = {"said": [], "unsaid": []}
            for _ in range(args.rounds):
                for name in seen:
                    HIGHS.clear()
                    cpu = time.process_time()
                    with intra_op.least_memory_unsaid() if name == "unsaid" else \
                            contextlib.nullcontext():
                        try:
                            plan = intra_op.plan_intra_op(graph, mesh, method, blocks=blocks,
                                                          inputs=search.inputs,
                                                          memo=search.pricing)
                            outcome = f"planned, est {plan.estimates.step_time_s!r}"
                        except InfeasibleError as e:
                            outcome = str(e).splitlines()[0]
                    cpu = time.process_time() - cpu
                    seen[name].append(cpu)
                    print(f"{c.describe()} {view} {name:6s}: {cpu:6.1f} s CPU | HiGHS "
                          f"{len(HIGHS)} runs {sum(HIGHS):6.1f} s | load "
                          f"{os.getloadavg()[0]:.1f} | {outcome}", flush=True)
            print(f"  {view}: CPU unsaid / said "
                  f"{sum(seen['unsaid']) / sum(seen['said']):.2f}", flush=True)
        raise _Done
    return measure


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--views", nargs="+", default=["4x2"])
    p.add_argument("--remat", default="full:2")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--regather", action="store_true")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    count_highs()
    auto._Search.solve_in_order = _measure(args)
    w, model, batch, cluster, precision = target_a(args.layers)
    with contextlib.suppress(_Done):
        torchalpa.plan(model, batch, w.loss_fn, cluster=cluster, mixed_precision=precision)


if __name__ == "__main__":
    main()
