"""How far the step-time lower bound sits under a plan, and how much of that gap a bound
from each op's cheapest strategy would close: ``python benchmarks/bound_gap.py 16``.

LLaMA-3-8B at ``layers`` layers (default 16), bf16, batch 16 x 8192 in 4 micro-batches,
1 x 8 H100 (target a's first candidate, as ``planning_cpu_ab.py``). Prints the bound the
search refuses candidates by (``passes/pricing/bounds.py``: every op's roofline over all
devices, launches, the optimizer), then per view the sum over ops of their cheapest
strategy's own cost (compute and internal all-reduces, the ILP's node cost; edges only
add): a lower bound of the compute any plan of that view pays. Compare both with the
plan's ``compute_s`` and ``step_time_s`` (``planning_cpu_ab.py`` prints the estimate).
"""

from __future__ import annotations

import argparse
import os

os.environ["TORCHALPA_CACHE"] = "0"

import torch  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402
from torchalpa.core.options import ShardParallel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("layers", type=int, nargs="?", default=16)
    args = p.parse_args()
    from torchalpa.parallel.shard import candidate_meshes
    from torchalpa.parallel.workflow import capture_examples, capture_step, with_precision
    from torchalpa.passes.pricing.bounds import step_profile
    from torchalpa.passes.sharding.costgraph import _own_costs
    from torchalpa.passes.sharding.intra_op import intra_op_problem
    k = 4
    w = zoo.llama3_8b().replace(num_layers=args.layers)
    with torch.device("meta"):
        model = w.build()
    model = with_precision(model, torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    graph = capture_step(model, capture_examples(model, w.example_inputs(device="meta"), k),
                         w.loss_fn).graph
    method = ShardParallel(num_micro_batches=k)
    meshes = candidate_meshes(torchalpa.Cluster.h100(1, 8), method)
    profile = step_profile(graph, meshes[0])
    print(f"bound (the search's): {profile.step_seconds(8, k, profile.batch):.4f} s/step")
    for mesh in meshes:
        _, priced_mesh, priced, space, _ = intra_op_problem(graph, mesh, method, "global")
        cheapest = sum(float(_own_costs(priced, priced_mesh, n, space.strategies[n.name]).min())
                       for n in priced if not n.is_leaf)
        print(f"view {'x'.join(map(str, mesh.shape))}: every op's cheapest strategy "
              f"{k * cheapest:.4f} s/step")


if __name__ == "__main__":
    main()
