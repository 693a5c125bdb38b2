"""Clusters several planning benchmarks share, built from whichever torchalpa they were given.

The benchmarks that compare two source trees (``polish_ab.py``, ``stage_phase_ab.py``) import
torchalpa only after ``in_tree.import_tree`` has chosen the tree, so this module imports
nothing of torchalpa itself: each function takes the imported package.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

GB = 1024 ** 3


def v100_like(torchalpa: ModuleType, nodes: int) -> Any:
    """The origin simulation's cluster (target b, ``llama13b_remat.py``): ``nodes`` nodes of 4
    devices of 32 GB, 100 GB/s within a node and 1 GB/s between nodes, V100-like compute."""
    return torchalpa.Cluster(num_nodes=nodes, devices_per_node=4, memory_per_device=32 * GB,
                             peak_flops=112e12, memory_bandwidth=900e9,
                             intra_node_bandwidth=100e9, intra_node_latency=1e-6,
                             inter_node_bandwidth=1e9, inter_node_latency=1e-6,
                             name="v100-like 32GB")
