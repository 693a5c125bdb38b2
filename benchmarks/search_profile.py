"""Where the pipeline search's time goes: every exact stage solve and every HiGHS run.

    cd benchmarks && python search_profile.py --row 15b [--workers 2] [other search_ab flags]

Runs ``search_ab.py`` (the weak-scaling row's automatic search) with three probes:
each exact stage solve (``ExactStages._solve_stage``: layers, submesh, view, micro-batches
in flight, seconds, the latency it found), each HiGHS run that took a second or more or
did not end optimal (seconds, HiGHS's own status, so the runs stopped by the time limit
show as ``kTimeLimit``, and the gap left) and the search's INFO log (which uniform
partitions were priced). Lines go to stderr as they happen, from the forked workers
too, each tagged with its process id; a stage solve's line follows the HiGHS runs it made.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import search_ab

from torchalpa.passes.pipeline_search.exact_stages import ExactStages
from torchalpa.passes.sharding import ilp_highs


def _say(text: str) -> None:
    print(f"[{os.getpid()} {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _probe_stage_solves() -> None:
    solve_stage = ExactStages._solve_stage

    def timed(self, k, i, submesh, view, flight, received, *budget):
        start = time.perf_counter()
        found = solve_stage(self, k, i, submesh, view, flight, received, *budget)
        seconds, lean, _ = found
        _say(f"stage solve layers {k}..{i} on {submesh} as {view}, {flight} in flight"
             f"{', recomputed' if received is not None else ''}"
             f"{f', budget {budget[0]} s' if budget and budget[0] else ''}: "
             f"{time.perf_counter() - start:.1f} s -> latency {seconds}, lean {lean}")
        return found

    ExactStages._solve_stage = timed


def _probe_highs() -> None:
    read = ilp_highs._read

    def reading(h):
        info = h.getInfo()
        if h.getRunTime() >= 1.0 or h.getModelStatus().name != "kOptimal":
            _say(f"  HiGHS {h.getModelStatus().name}: {h.getRunTime():.1f} s, "
                 f"{h.getNumCol()} columns, {h.getNumRow()} rows, gap {info.mip_gap:.2g}, "
                 f"objective {info.objective_function_value:.6g}")
        return read(h)

    ilp_highs._read = reading


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="[%(process)d %(asctime)s] %(name)s: %(message)s")
    logging.getLogger("torchalpa.planner").setLevel(logging.INFO)
    _probe_stage_solves()
    _probe_highs()
    search_ab.main()
