"""Target b's stage phase, one candidate planned alone as the search plans it, with each
exact stage solve and each of its HiGHS runs logged, and the runs' models saved for
``stage_levers_ab.py`` / ``highs_options_ab.py``:

    OMP_NUM_THREADS=1 TORCHALPA_CACHE=0 TORCHALPA_LOG=info timeout 1500 \\
        python -u benchmarks/stage_phase_probe.py /tmp/corpus/stage [--candidate selective:2]

The origin job (LLaMA-2-13B, batch 200, 50 x 4 devices of 32 GB); the search's own
``solve`` on the one pipeline candidate (remat mode and micro-batches) instead of its
whole order. Per HiGHS run of a stage solve: the model's columns and rows, the start's
size, the status (``kSolutionLimit``: the node limit), nodes, simplex iterations,
objective, dual bound, gap and CPU seconds; per stage solve: its layers, submesh, view,
micro-batches in flight, graph nodes, price and the worker's CPU seconds. Models go to
``<dir>/<stage>/<pid>-<n>.npz``. Each run is solved as ``ilp_highs.solve_with_highs``
solves it (the same calls), so the search and its answers are the planner's own.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _clusters import v100_like  # noqa: E402
from highs_dump import save_model  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402
from torchalpa.parallel import auto  # noqa: E402
from torchalpa.passes.pipeline_search import exact_stages  # noqa: E402
from torchalpa.passes.sharding import ilp_highs  # noqa: E402

_stage: dict[str, object] = {"tag": None, "runs": 0}


def _logged_solve(directory: str):
    """``solve_with_highs`` as the planner runs it, saving and logging each run of a stage
    solve."""
    plain = ilp_highs.solve_with_highs

    def solve(model, *, time_limit, gap, verbose, max_nodes=None):
        tag = _stage["tag"]
        if tag is None or not model.names:
            return plain(model, time_limit=time_limit, gap=gap, verbose=verbose,
                         max_nodes=max_nodes)
        _stage["runs"] = int(str(_stage["runs"])) + 1
        os.makedirs(os.path.join(directory, str(tag)), exist_ok=True)
        name = f"{os.getpid()}-{_stage['runs']}.npz"
        save_model(os.path.join(directory, str(tag), name), model, gap=gap,
                   max_nodes=max_nodes, time_limit=time_limit)
        h, position = ilp_highs.started_highs(model, time_limit=time_limit, gap=gap,
                                              verbose=False, max_nodes=max_nodes)
        start = time.process_time()
        h.run()
        cpu = time.process_time() - start
        info = h.getInfo()
        print(f"HIGHS {tag} {name} cols {len(model.names)} rows {len(model.row_lower)} "
              f"start {len(model.initial)} gap {gap} maxnodes {max_nodes} status "
              f"{h.getModelStatus().name} nodes {info.mip_node_count} iters "
              f"{info.simplex_iteration_count} obj {info.objective_function_value:.9g} dual "
              f"{info.mip_dual_bound:.9g} mipgap {info.mip_gap:.3g} cpu {cpu:.2f}", flush=True)
        status, values = ilp_highs._read(h)   # noqa: SLF001 -- the planner's own reading
        n = len(model.names)
        return (status, values[position] if values.size == n else np.zeros(n),
                h.getModelStatus().name == "kTimeLimit")

    return solve


def _traced(solve_stage):
    """``ExactStages._solve_stage`` tagging its HiGHS runs and logging its result."""
    def traced(self, k, i, submesh, view, flight, received, budget=None):
        start = time.process_time()
        nodes = len(self.problem.stage_graph(k, i))
        _stage["tag"] = (f"s{k}-{i}_{'x'.join(map(str, submesh))}_as_"
                         f"{'x'.join(map(str, view))}_f{flight}")
        try:
            found = solve_stage(self, k, i, submesh, view, flight, received, budget)
        finally:
            _stage["tag"] = None
        print(f"STAGE {k}..{i} on {submesh} as {view} flight {flight} recompute "
              f"{received is not None} budget {budget} nodes {nodes}: "
              f"{'inf' if found[0] is None else found[0]} cpu "
              f"{time.process_time() - start:.1f} pid {os.getpid()}", flush=True)
        return found
    return traced


def _one_candidate(remat: str, micro_batches: int):
    """``_Search.solve_in_order`` planning only the pipeline candidate asked for."""
    def run(self, candidates):
        c = next(c for c in candidates if c.kind == "pipeline" and c.remat == remat
                 and c.num_micro_batches == micro_batches)
        plan = self.solve(c if c.exact else self.exact_candidate(c))
        print(f"PLANNED {remat}:{micro_batches}: est {plan.estimates.step_time_s:.6g} s/step",
              flush=True)
        raise SystemExit(0)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="where the stage solves' models are saved")
    parser.add_argument("--candidate", default="selective:2", help="remat:micro-batches")
    args = parser.parse_args()
    remat, micro_batches = args.candidate.split(":")
    ilp_highs.solve_with_highs = _logged_solve(args.directory)
    exact_stages.ExactStages._solve_stage = _traced(exact_stages.ExactStages._solve_stage)
    auto._Search.solve_in_order = _one_candidate(remat, int(micro_batches))
    workload = zoo.llama2_13b(batch_size=200)
    with torch.device("meta"):
        model = workload.build()
    torchalpa.plan(model, workload.example_inputs(device="meta"), workload.loss_fn,
                   cluster=v100_like(torchalpa, 50))


if __name__ == "__main__":
    main()
