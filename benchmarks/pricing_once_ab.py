"""A node's cost per strategy priced once per graph and view, against priced again by every
cost graph (what the solves of one mesh did before): the same intra-op plans, and the
ratio of the solve times, measured in one process, alternating the order.

    python benchmarks/pricing_once_ab.py                       # LLaMA, 4 layers, 1 x 8 H100
    python benchmarks/pricing_once_ab.py --layers 8 --rounds 2

Each round plans the captured step on every 1D and 2D view of the cluster with
``ShardParallel`` (no plan cache), once with the memo and once without; the line says the
seconds of each, their ratio, and whether the plans' estimates are equal. Wall-clock times
on a shared machine: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import ShardParallel
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel.shard import blocks_of, candidate_meshes, plan_graph
from torchalpa.passes.sharding import costgraph


def _priced_again(graph, mesh, node, strategies):
    """``_own_costs`` without its memo: priced on every call (the behaviour before)."""
    costgraph._OWN_COSTS.pop(graph, None)
    return memoized(graph, mesh, node, strategies)


memoized = costgraph._own_costs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    os.environ["TORCHALPA_CACHE"] = "0"
    w = zoo.llama3_8b(batch_size=8, seq_len=2048)
    w = w.replace(num_layers=args.layers)
    with torch.device("meta"):
        model = w.build()
    graph = capture(model, w.example_inputs(device="meta"), w.loss_fn).graph
    cluster = torchalpa.Cluster.h100(1, 8)
    method = ShardParallel()
    meshes = candidate_meshes(cluster, method)
    for r in range(args.rounds):
        seconds, steps = {}, {}
        for variant in (("memo", "again") if r % 2 == 0 else ("again", "memo")):
            costgraph._own_costs = memoized if variant == "memo" else _priced_again
            costgraph._OWN_COSTS.clear()
            start = time.perf_counter()
            plan = plan_graph(graph, method=method, meshes=meshes, blocks=blocks_of(graph))
            seconds[variant] = time.perf_counter() - start
            steps[variant] = plan.estimates["step_time_s"]
            for note in plan.notes:
                if note.startswith(("the solver's time limit", "logical meshes tried")):
                    print(f"    {variant}: {note}", flush=True)
        costgraph._own_costs = memoized
        print(f"round {r + 1} ({args.layers} layers, {len(graph)} nodes, load "
              f"{os.getloadavg()[0]:.1f}): priced once {seconds['memo']:.1f} s, priced by "
              f"every cost graph {seconds['again']:.1f} s, ratio "
              f"{seconds['memo'] / seconds['again']:.2f}; estimates {steps['memo']:.6g} and "
              f"{steps['again']:.6g} s/step", flush=True)


if __name__ == "__main__":
    main()
