"""The pipeline search with and without leaving stage variants unsolved by their LP bounds
(``PassSwitches.stage_bounds``), in one process, alternately.

    python benchmarks/stage_bounds_ab.py [--nodes 1 --devices 4 --memory-gb 0.03] [--repeats 1]

Plans the pipeline-search tests' small GPT (4 layers, 256 wide, batch 8 x 64, 8
micro-batches; ``tests/search_models.py``) on ``--nodes`` x ``--devices`` devices of
``--memory-gb`` each. Prints per run the stage ILPs, the variants cut and the bounds
computed (from the search's log), the estimate and the wall seconds, then the ratio of the
two settings' seconds (one run of each per repeat, so both see the same load). Both
settings must print the same plan (the line says whether the plans, clock readings
aside, are equal), unless the solver's 60-s time limit fired in one (the line says so).
Row 15b of the weak-scaling suite: ``search_profile.py --row 15b`` (RESULTS.md).
"""

from __future__ import annotations

import argparse
import io
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from search_models import small_cluster, small_gpt_graph, small_pipeline  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.core.switches import PassSwitches  # noqa: E402
from torchalpa.passes.pipeline_search.inter_op import plan_pipeline  # noqa: E402
from torchalpa.passes.sharding.ilp import CLOCK_NOTE  # noqa: E402

CLOCKS = ("solve_seconds", "ilp_seconds", "total_seconds", "search_seconds")


def _search(graph, cluster: torchalpa.Cluster, on: bool) -> tuple[float, dict, str]:
    log, caught = logging.getLogger("torchalpa.planner"), io.StringIO()
    handler = logging.StreamHandler(caught)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    start = time.perf_counter()
    try:
        with PassSwitches.using(stage_bounds=on):
            plan = plan_pipeline(graph, cluster, small_pipeline(), workers=1)
    finally:
        log.removeHandler(handler)
    seconds = time.perf_counter() - start
    cut = sum(line.endswith(": not solved") for line in caught.getvalue().splitlines())
    e = plan.estimates
    clock = any(note.startswith(CLOCK_NOTE) for note in plan.notes)
    return seconds, _without_clocks(plan.to_dict()), (
        f"stage ILPs {e.stage_solves}, variants cut {cut}, est {e.step_time_s!r} s, "
        f"{len(plan.stages)} stages{', CLOCK FIRED' if clock else ''}")


def _without_clocks(found):
    if isinstance(found, dict):
        return {k: _without_clocks(v) for k, v in found.items() if k not in CLOCKS}
    if isinstance(found, list):
        return [_without_clocks(v) for v in found]
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--memory-gb", type=float, default=0.03)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    graph = small_gpt_graph()
    cluster = small_cluster(args.memory_gb, nodes=args.nodes, devices=args.devices)
    for _ in range(args.repeats):
        times, plans = {}, {}
        for on in (False, True):
            times[on], plans[on], line = _search(graph, cluster, on)
            print(f"bounds {'on' if on else 'off'}: {times[on]:.1f} s, {line}", flush=True)
        print(f"on / off seconds: {times[True] / times[False]:.2f}; plans "
              f"{'equal' if plans[True] == plans[False] else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main()
