"""Writes into a buffer nothing reads afterwards, made and priced in place or not: one
device's measured peak and the plan's estimate, and the memory model's activation peak of
published rows, with the rule on and off in one run.

    TORCHALPA_CACHE=0 OMP_NUM_THREADS=1 python benchmarks/inplace_reuse_ab.py [ROW ...]

"off" replaces, in this process, the rule of ``passes/pricing/buffer_reuse.py`` (the
memory model) and ``runtime/rewrites/write_in_place.py`` (the runtime) by "never", so
the step is run and priced as captured: ``scatter(full_like(x), ...)`` out of place.
The small model is ``tests/test_memory_measured.py``'s top-two mask (a scatter of ones
into zeros, the step's largest transient); eager's peak is measured beside it. Rows
(``published_rows``): the activation peak of one replica's micro-batch on one device,
as ``published_memory.py`` prints it.
"""

from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]

MB = 1e6
GiB = 2 ** 30


def _switch(on: bool) -> None:
    """The rule on (as shipped) or off (never in place), on both sides."""
    import torchalpa.passes.pricing.memory as memory
    import torchalpa.runtime.rewrites.program_rewrites as rewrites
    from torchalpa.passes.pricing.buffer_reuse import in_place_root
    from torchalpa.runtime.rewrites.write_in_place import write_in_place
    memory.in_place_root = in_place_root if on else (lambda *a, **k: None)
    rewrites.write_in_place = write_in_place if on else (lambda *a, **k: 0)
    memory._LIVENESS.clear()


def small_model(on: bool) -> tuple[int, int, float]:
    """(eager peak, runtime peak, estimate less the inputs), bytes, for the top-two mask
    (``tests/test_memory_measured.top_two_peaks``)."""
    from test_memory_measured import top_two_peaks
    _switch(on)
    reference, measured, inputs = top_two_peaks()
    estimate = measured.result.plan.estimates.memory_per_device_bytes - inputs
    return reference.peak, measured.peak, estimate


def row_peak(key: str, on: bool) -> tuple[float, str]:
    """(activation peak GiB, the op there) of ``key`` as ``published_memory.py`` has it."""
    from dataclasses import replace

    import published
    from published_rows import ROWS

    from torchalpa.core.placement import Replicate
    from torchalpa.passes.pricing.memory import activation_timeline, liveness
    _switch(on)
    row = next(r for r in ROWS if r.key == key)
    row = replace(row, dp=1, num_nodes=1, devices_per_node=1, tp=1, pp=1,
                  global_batch=row.micro_batch)
    graph = published.pinned_step(row)
    outputs = {n.name: tuple((Replicate(),) for _ in n.outputs) for n in graph}
    timeline = activation_timeline(graph, liveness(graph), outputs, (1,))
    at = [n for n in graph][min(int(np.argmax(timeline)), len(graph) - 1)]
    return float(timeline.max()) / GiB, f"{at.phase} {at.op}"


def main(rows: list[str]) -> None:
    print("top-two mask on one CPU device, 3 AdamW steps (MB): eager, runtime, estimate "
          "less inputs")
    for on in (False, True):
        eager, runtime, estimate = small_model(on)
        print(f"  {'on ' if on else 'off'}  eager {eager / MB:7.2f}  runtime {runtime / MB:7.2f}"
              f" ({runtime / eager:.2f})  estimate {estimate / MB:7.2f} ({estimate / eager:.2f})")
    for key in rows:
        (off, where_off), (on_, where_on) = row_peak(key, False), row_peak(key, True)
        print(f"{key}: activation peak off {off:.2f} GiB ({where_off}), on {on_:.2f} GiB "
              f"({where_on})")


if __name__ == "__main__":
    main(sys.argv[1:])
