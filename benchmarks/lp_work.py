"""Run a benchmark script counting the HiGHS runs of this process that solve an LP (no
integer column: the search's bounds) and those that solve a MIP, with their simplex
iterations and CPU seconds, printed when the script ends:

    python benchmarks/in_tree.py <tree> benchmarks/lp_work.py \
        <tree>/benchmarks/auto_targets.py --targets a

Work that does not depend on the load (runs, iterations) beside the CPU seconds HiGHS'
``run`` took. View workers forked by the search (``cpu_workers``) solve in their own
processes and are not counted: the bounds run in the search's own process.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import time

import highspy

COUNTS = {"LP": [0, 0, 0.0], "MIP": [0, 0, 0.0]}
"""kind -> [runs, simplex iterations, CPU seconds of ``run``]."""
_run = highspy.Highs.run


def _counted(h):
    start = time.process_time()
    status = _run(h)
    kind = "MIP" if any(t != highspy.HighsVarType.kContinuous
                        for t in h.getLp().integrality_) else "LP"
    entry = COUNTS[kind]
    entry[0] += 1
    entry[1] += h.getInfo().simplex_iteration_count
    entry[2] += time.process_time() - start
    return status


def _report() -> None:
    if os.getpid() != PID:
        return
    for kind, (runs, iterations, seconds) in COUNTS.items():
        print(f"lp_work: {kind} {runs} HiGHS runs, {iterations} simplex iterations, "
              f"run CPU {seconds:.1f} s", flush=True)


PID = os.getpid()
highspy.Highs.run = _counted  # type: ignore[method-assign]
atexit.register(_report)
if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
