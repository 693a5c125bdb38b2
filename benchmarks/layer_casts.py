"""Target e's layers with mixed precision's casts cut in forward's order (main before
r10-scale) or placed with their readers (``passes/pipeline_search/layers.py::parameter_ops``):
distinct layers, blocks per layer and the layer phase's ILP jobs, counted without solving.

    python benchmarks/layer_casts.py                   # LLaMA-3-70B, 80 blocks, 16 layers
    python benchmarks/layer_casts.py --blocks 16 --layers 8 --solve

Captures LLaMA-3-70B (``--blocks`` decoder layers) in bfloat16 (``CastForward``, as
``torchalpa.plan(mixed_precision=...)`` captures it) at one micro-batch of 16 (target e's
first candidate: batch 128 x 8192, 16 micro-batches), cuts it into ``--layers`` layers
both ways and counts what the pipeline search's layer phase would solve on 16 x 8 H100:
one ILP per (distinct layer, class of views). ``--solve`` also runs both layer phases,
in turn in this process (workers as the search has them), and prints their seconds and
the ratio of the two (the VM may be shared: one run's ratio, not absolute times).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections import Counter

import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.calls import CallSignature
from torchalpa.core.opgraph import block_of
from torchalpa.core.options import AutoLayerOption, PipeshardParallel
from torchalpa.parallel.workflow import capture_examples, capture_step, with_precision
from torchalpa.passes.pipeline_search import layers as layering
from torchalpa.passes.pipeline_search.layer_cache import SolveCache
from torchalpa.passes.pipeline_search.layer_costs import LayerCosts
from torchalpa.passes.pipeline_search.pricing_memo import PricingMemo
from torchalpa.passes.pipeline_search.search_problem import SearchProblem
from torchalpa.passes.pipeline_search.stage_jobs import cpu_workers
from torchalpa.passes.pipeline_search.stages import submesh_shapes


class _Counted(LayerCosts):
    """The layer phase's jobs, counted and not solved."""

    def _solve_all(self, requests, workers):
        self.jobs = len({(self.problem.signature[l], members, lean)
                         for l, members, lean in requests})


@contextlib.contextmanager
def _casts_in_order(on: bool):
    """Main's layering before r10-scale: no op follows its readers."""
    if not on:
        yield
        return
    kept = layering.parameter_ops
    layering.parameter_ops = lambda graph: set()
    try:
        yield
    finally:
        layering.parameter_ops = kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=80)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--solve", action="store_true")
    args = p.parse_args()
    workload = zoo.llama3_70b().replace(num_layers=args.blocks)
    with torch.device("meta"):
        model = with_precision(workload.build(), torchalpa.MixedPrecision(
            param_dtype=torch.bfloat16))
    signature, tensors = CallSignature.of(workload.example_inputs(device="meta"))
    graph = capture_step(model, capture_examples(model, tensors, 16), workload.loss_fn,
                         signature=signature).graph
    cluster = torchalpa.Cluster.h100(num_nodes=16)
    method = PipeshardParallel(num_micro_batches=16,
                               layer_option=AutoLayerOption(layer_num=args.layers))
    shapes = submesh_shapes(cluster.num_nodes, cluster.devices_per_node)
    seconds = {}
    for label, in_order in (("casts in forward's order (main)", True),
                            ("casts with their readers (r10-scale)", False)):
        with _casts_in_order(in_order):
            layer = layering.assign_layers(graph, method, cluster.num_devices)
        problem = SearchProblem(graph, layer, cluster, method, "global")
        blocks = Counter()
        for node in graph.ops():
            found = block_of(node.module) if node.module and node.phase == "forward" else None
            if found is not None:
                blocks[layer[node.name], found[1]] += 1
        per_layer = [len({b for (l, b) in blocks if l == at}) for at in range(args.layers)]
        counted = _Counted(problem, SolveCache(), PricingMemo())
        counted.prefetch(shapes, workers=1, max_in_flight=16)
        print(f"{label}: {len(set(problem.signature))} distinct layers of {args.layers}, "
              f"blocks touched per layer {per_layer}, layer-phase ILP jobs "
              f"{counted.jobs}", flush=True)
        if args.solve:
            start = time.perf_counter()
            costs = LayerCosts(problem, SolveCache(), PricingMemo())
            costs.prefetch(shapes, workers=cpu_workers(), max_in_flight=16)
            seconds[label] = time.perf_counter() - start
            print(f"    layer phase {seconds[label]:.1f} s, {costs.solves} layer ILPs "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    if len(seconds) == 2:
        main_s, branch_s = seconds.values()
        print(f"layer phase with the casts placed / in order: {branch_s / main_s:.3f}")


if __name__ == "__main__":
    main()
