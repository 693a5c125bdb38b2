"""The weak-scaling automatic search with and without the search's fast paths, same process setup.

    python benchmarks/search_ab.py --row 1.3b [--before] [--micro-batches 64] [--workers 1]

Plans one row of ``weak_scaling.py`` automatically (``remat`` chosen between both
captures) in one process without a worker pool, and prints the plan, wall and CPU seconds.
``--before`` switches off what branch s4-search added, to measure it on the same machine
under the same load: the ILP through PuLP instead of straight into HiGHS
(``PassSwitches.direct_highs``), resharding prices, rule strategies, reachability and layer
subgraphs made again for every solve instead of kept, and every capture planned even when
its compute bound cannot win. Both settings must print the same plan.
"""

from __future__ import annotations

import argparse
import resource
import time

import weak_scaling as ws

import torchalpa
from torchalpa.core.options import AutoLayerOption, PipeshardParallel
from torchalpa.core.switches import PassSwitches
from torchalpa.passes.pipeline_search import inter_op
from torchalpa.passes.pipeline_search.layer_costs import LayerCosts
from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
from torchalpa.passes.sharding import costgraph, intra_op
from torchalpa.passes.sharding.remat_choice import compute_lower_bound, plan_with_remat


def switch_off_fast_paths() -> None:
    """Restore the per-solve behaviour of the search before branch s4-search (but the PuLP
    path, which ``main`` switches by ``PassSwitches.direct_highs``)."""
    # no pricing work kept across solves: fresh reshard prices, strategies, reachability
    PricingMemo.reshard_costs = lambda self, mesh, rs=True, forbidden=frozenset(): \
        costgraph.ReshardCosts(mesh, rs, forbidden)
    build = intra_op.build_strategies

    def per_solve_memos(graph, mesh, inputs="global", option=None, memo=None):
        return build(graph, mesh, inputs, option, PricingMemo())

    intra_op.build_strategies = per_solve_memos
    layer_graph = LayerCosts.layer_graph

    def per_solve_subgraph(self, l):
        self._layer_graphs.clear()
        return layer_graph(self, l)

    LayerCosts.layer_graph = per_solve_subgraph


def _cpu() -> float:
    """CPU seconds of this process and of its finished worker processes."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description="the weak-scaling auto search, fast paths on or off")
    p.add_argument("--row", default="1.3b", choices=list(ws.ROWS))
    p.add_argument("--micro-batches", type=int, default=64)
    p.add_argument("--before", action="store_true", help="switch the fast paths off")
    p.add_argument("--workers", type=int, default=1,
                   help="processes for independent solves (1: all in this one, so its CPU "
                        "seconds are the search's; more: CPU counts the workers too)")
    args = p.parse_args()
    if args.before:
        switch_off_fast_paths()
    row = ws.ROWS[args.row]
    cluster = torchalpa.Cluster.h100(num_nodes=max(1, row.devices // 8),
                                     devices_per_node=min(8, row.devices))
    B = args.micro_batches
    variants = ws.captures(row, ws.GLOBAL_BATCH // B)
    base = PipeshardParallel(num_micro_batches=B, layer_option=AutoLayerOption(layer_num=8),
                             auto_sharding_option=torchalpa.AutoShardingOption(solver="highs",
                                                                               remat="auto"))
    bound = None if args.before else (lambda v: compute_lower_bound(v.graph, cluster, B))
    pricing = PricingMemo()     # shared by both captures' searches, as the solves repeat it
    wall, cpu = time.perf_counter(), _cpu()
    with PassSwitches.using(direct_highs=not args.before):
        plan = plan_with_remat(variants, lambda v: inter_op.plan_pipeline(
                                   v.graph, cluster, base, pricing=pricing,
                                   workers=args.workers),
                               lambda v: v.graph, bound)
    print(f"{'before' if args.before else 'after'} {args.row}: step "
          f"{ws._step(plan, cluster):.6g} s, stages {plan.forward_stage_layer_ids} on "
          f"{plan.submesh_shapes} as {plan.logical_shapes}, remat {plan.method['remat']}; "
          f"search wall {time.perf_counter() - wall:.1f} s, CPU {_cpu() - cpu:.1f} s "
          f"({args.workers} worker{'s' if args.workers > 1 else ''})")
    print(" ", plan.notes[-1])


if __name__ == "__main__":
    main()
