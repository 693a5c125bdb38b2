"""What the benchmarks that time target a's planning in this tree share
(``least_memory_ab.py``, ``polish_start_ab.py``, ``dp_layout_ab.py``): HiGHS runs counted
with their CPU seconds, and target a's model. (``polish_ab.py`` counts its own: it imports the tree it
measures at run time.)

``count_highs()`` wraps ``ilp_highs.solve_with_highs`` once per process (solvers look it up
on the module at each call, so the wrapper sees every run, forked workers' excepted);
``HIGHS`` then holds each run's CPU seconds (``time.process_time``) since it was last
cleared. ``target_a(layers)`` is LLaMA-3-8B bf16 cut to ``layers`` decoder layers, batch
16 x 8192 on the meta device, and the cluster of issue 46's target a (1 x 8 H100).
"""

from __future__ import annotations

import time

import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.passes.sharding import ilp_highs

__all__ = ["HIGHS", "count_highs", "target_a"]

HIGHS: list[float] = []
"""CPU seconds of each HiGHS run since the list was last cleared."""


def count_highs() -> None:
    """Append each later HiGHS run's CPU seconds to ``HIGHS`` (idempotent)."""
    solve = ilp_highs.solve_with_highs
    if getattr(solve, "counted", False):
        return

    def counted(*args, **kwargs):
        start = time.process_time()
        try:
            return solve(*args, **kwargs)
        finally:
            HIGHS.append(time.process_time() - start)

    counted.counted = True  # type: ignore[attr-defined]
    ilp_highs.solve_with_highs = counted


def target_a(layers: int = 32):
    """(workload, meta model, meta batch, cluster, mixed precision) of target a at
    ``layers`` decoder layers."""
    w = zoo.llama3_8b().replace(num_layers=layers)
    with torch.device("meta"):
        model = w.build()
    return (w, model, w.example_inputs(device="meta"), torchalpa.Cluster.h100(1, 8),
            torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
