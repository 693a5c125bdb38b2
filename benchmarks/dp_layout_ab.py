"""Target a's AutoParallel search, its work counted: what weighing the data-parallel
layout beside each intra-op candidate costs (``torchalpa/parallel/dp_layout.py``).

    git -C /work/main archive main | tar -x -C /tmp/base
    taskset -c 0 python benchmarks/in_tree.py /tmp/base benchmarks/dp_layout_ab.py
    taskset -c 1 python benchmarks/dp_layout_ab.py
    taskset -c 1 python benchmarks/dp_layout_ab.py 2        # the model cut to 2 layers

LLaMA-3-8B bf16, batch 16 x 8192, 1 x 8 H100 (``auto_targets.py`` target a, AutoParallel's
plan alone, the hand plan left out; an argument cuts the model to that many layers). Run
on one core (``taskset``): the search then solves its views in this process
(``cpu_workers`` is the cores it may use), so every HiGHS run is counted here and the CPU
seconds are all this process's. Prints CPU seconds of the plan call (capture included),
HiGHS runs and their CPU seconds, the candidates planned and weighed (from the plan's
notes), the estimate, the plan JSON's hash (``in_tree.plan_text``) and the notes on the
data-parallel layout.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time

os.environ["TORCHALPA_CACHE"] = "0"

from in_tree import plan_text  # noqa: E402

import torchalpa  # noqa: E402


def main() -> None:
    from _planning import HIGHS, count_highs, target_a
    count_highs()
    w, model, batch, cluster, bf16 = target_a(int(sys.argv[1]) if len(sys.argv) > 1 else 32)
    wall, cpu = time.perf_counter(), time.process_time()
    plan = torchalpa.plan(model, batch, w.loss_fn, cluster=cluster, mixed_precision=bf16)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    text = plan_text(plan)
    tried = [n for n in plan.notes if n.startswith("  tried: ")]
    planned = 1 + sum(1 for n in tried if re.search(r": est [0-9.eE+-]+ s/step", n))
    print(f"{torchalpa.__file__}: {cpu:.1f} s CPU, {wall:.1f} s wall (load "
          f"{os.getloadavg()[0]:.1f}) | {len(HIGHS)} HiGHS runs ({sum(HIGHS):.1f} s CPU) | "
          f"{planned} candidates planned of {1 + len(tried)} weighed | est "
          f"{plan.estimates.step_time_s!r} s/step, mesh {'x'.join(map(str, plan.mesh_shape))} "
          f"| plan {hashlib.sha256(text.encode()).hexdigest()[:16]}", flush=True)
    for note in plan.notes:
        if note.startswith(("AutoParallel", "runner-up")) or "data-parallel layout" in note:
            print("   ", note)


if __name__ == "__main__":
    main()
