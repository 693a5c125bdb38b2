"""The pipeline search near the memory budget, with and without trusting the solver's proofs
that a stage does not fit (``PassSwitches.trust_proofs``), in one process, alternately.

    python benchmarks/stage_unfit_ab.py [--memory-gb 0.035] [--repeats 1]

Plans the pipeline-search tests' small GPT (4 layers, 256 wide, batch 8 x 64, 8
micro-batches; ``tests/search_models.py``) on 2 x 2 devices of ``--memory-gb`` each: at
0.035 GB half the stages the DP picks do not fit. Prints per run the stage solves, the
stage ILPs, the stages proved not to fit, the estimate and the wall seconds, then the
ratio of the two settings' seconds (one run of each per repeat, so both see the same
load). Both settings must print the same estimate, unless the solver's 60-s time limit
fired in one (the line says so: the plan then depends on the machine's load).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from search_models import small_cluster, small_gpt_graph, small_pipeline  # noqa: E402

from torchalpa.core.switches import PassSwitches  # noqa: E402
from torchalpa.passes.pipeline_search.inter_op import plan_pipeline  # noqa: E402
from torchalpa.passes.sharding.ilp import CLOCK_NOTE  # noqa: E402


def _search(graph, memory_gb: float, trust: bool) -> tuple[float, str]:
    cluster = small_cluster(memory_gb)
    method = small_pipeline()
    start = time.perf_counter()
    with PassSwitches.using(trust_proofs=trust):
        plan = plan_pipeline(graph, cluster, method, workers=1)
    seconds = time.perf_counter() - start
    e = plan.estimates
    clock = any(note.startswith(CLOCK_NOTE) for note in plan.notes)
    return seconds, (f"stage ILPs {e.stage_solves}, est {e.step_time_s!r} s, "
                     f"{len(plan.stages)} stages{', CLOCK FIRED' if clock else ''}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--memory-gb", type=float, default=0.035)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    graph = small_gpt_graph()
    for _ in range(args.repeats):
        times = {}
        for trust in (False, True):
            times[trust], line = _search(graph, args.memory_gb, trust)
            print(f"proofs {'trusted' if trust else 'ignored'}: {times[trust]:.1f} s, {line}",
                  flush=True)
        print(f"trusted / ignored seconds: {times[True] / times[False]:.2f}", flush=True)


if __name__ == "__main__":
    main()
