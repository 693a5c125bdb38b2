"""A published row's estimate with its nodes' network replaced: how much of the estimate
hangs on the network its machine preset assumes.

    cd benchmarks && python published_network.py bigscience-tr1-13b-v100x256 100 25

Arguments: the row, then Gb/s per node (all the node's NICs together) to price it with, one
estimate each (``published.estimate`` with ``NodeSpec.network_bandwidth`` replaced in the
row's preset for this process only).
"""

from __future__ import annotations

import dataclasses
import sys

import published
from published_rows import ROWS

from torchalpa.core import gpu_specs


def main(key: str, gbits: list[float]) -> None:
    row = next((r for r in ROWS if r.key == key), None)
    if row is None:
        sys.exit(f"unknown row {key!r}")
    preset = gpu_specs.NODE_PRESETS[row.machine]
    print(f"{key}: published {row.published_step_s():.3f} s; the preset "
          f"{row.machine!r} has {preset.network_bandwidth / gpu_specs.Gbit:g} Gb/s per node")
    for gbit in gbits:
        gpu_specs.NODE_PRESETS[row.machine] = dataclasses.replace(
            preset, network_bandwidth=gbit * gpu_specs.Gbit)
        e = published.estimate(row)
        stages = f"; stages {', '.join(f'{s:.3f}' for s in e.stage_s)} s" if e.stage_s else ""
        print(f"  {gbit:g} Gb/s per node: {e.step_s:.3f} s "
              f"(est/pub {e.step_s / row.published_step_s():.2f}){stages}")
    gpu_specs.NODE_PRESETS[row.machine] = preset


if __name__ == "__main__":
    main(sys.argv[1], [float(a) for a in sys.argv[2:]])
