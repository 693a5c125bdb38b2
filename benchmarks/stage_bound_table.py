"""How close a pipeline stage's LP bound (``ExactStages.lower_bound``) is to its price.

    python benchmarks/stage_bound_table.py                 # the tests' small GPT, solved too
    python benchmarks/stage_bound_table.py --row 15b       # weak-scaling row 15b, bounds only

Without ``--row``: the pipeline-search tests' small GPT (``tests/search_models.py``) on one
node of 4 devices (10 GB each: everything fits); per stage and view the exact price
(``ExactStages.exact``), the LP bound, their ratio and the seconds of each. With ``--row``:
the weak-scaling row's GPT (64 micro-batches, remat none) on its H100 cluster, the stages
its search prices (layers 0-3 and 4-7 on (2, 8), 0-7 on (4, 8)): bounds only (a solve is
minutes; ``search_profile.py`` prints the solves' prices).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import weak_scaling as ws  # noqa: E402
from search_models import exact_stages, small_cluster, small_gpt_graph, small_pipeline  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.core.options import AutoLayerOption, PipeshardParallel  # noqa: E402
from torchalpa.passes.pipeline_search.layers import assign_layers  # noqa: E402


def _small() -> None:
    graph, method = small_gpt_graph(), small_pipeline()
    cluster = small_cluster(10, nodes=1, devices=4)
    exact = exact_stages(graph, assign_layers(graph, method, cluster.num_devices), cluster,
                         method)
    for k, i in [(0, 0), (0, 1), (2, 3), (0, 3)]:
        for submesh in [(1, 2), (1, 4)]:
            for view in exact.costs.layers.views(submesh):
                for flight in (1, 4):
                    start = time.perf_counter()
                    price, _ = exact.exact(k, i, submesh, view, flight)
                    solved = time.perf_counter() - start
                    bound = exact.lower_bound(k, i, submesh, view, flight)
                    bounded = time.perf_counter() - start - solved
                    ratio = f"{bound / price:.4f}" if price < float("inf") else "-"
                    print(f"layers {k}-{i} on {submesh} as {view}, {flight} in flight: price "
                          f"{price:.6g} s ({solved:.1f} s), bound {bound:.6g} s "
                          f"({bounded:.1f} s), bound/price {ratio}", flush=True)


def _row(name: str) -> None:
    row = ws.ROWS[name]
    cluster = torchalpa.Cluster.h100(num_nodes=max(1, row.devices // 8),
                                     devices_per_node=min(8, row.devices))
    B = 64
    graph = ws.captures(row, ws.GLOBAL_BATCH // B)["none"].graph
    method = PipeshardParallel(num_micro_batches=B, layer_option=AutoLayerOption(layer_num=8),
                               auto_sharding_option=torchalpa.AutoShardingOption(
                                   solver="highs", remat="auto"))
    exact = exact_stages(graph, assign_layers(graph, method, cluster.num_devices), cluster,
                         method)
    for k, i, submesh, flight in [(0, 3, (2, 8), 2), (4, 7, (2, 8), 1), (0, 7, (4, 8), 1)]:
        for view in exact.costs.layers.views(submesh):
            start = time.perf_counter()
            bound = exact.lower_bound(k, i, submesh, view, flight)
            print(f"layers {k}-{i} on {submesh} as {view}, {flight} in flight: bound "
                  f"{bound:.6g} s ({time.perf_counter() - start:.1f} s)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--row", choices=list(ws.ROWS), help="a weak-scaling row: bounds only")
    args = p.parse_args()
    if args.row:
        _row(args.row)
    else:
        _small()


if __name__ == "__main__":
    main()
