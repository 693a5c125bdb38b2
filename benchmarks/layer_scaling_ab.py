"""How one intra-op candidate's planning grows with the layer count, before and after:

    git archive main | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 python benchmarks/layer_scaling_ab.py /tmp/base [--layers 8 32]
        [--remat full:4 --micro-batches 2] [--rounds 1]

LLaMA-3-8B (bf16, batch 16 x 8192, 1 x 8 H100) at each layer count: one candidate like
target a's (``--micro-batches`` k, default 4; ``--remat`` a checkpointing policy, default
none), every view in turn, the big-graph path of ``plan_intra_op`` forced
(``exact_below=0, free_followers_below=0``), as ``planning_cpu_ab.py`` plans it. Each
(tree, layers) runs in its own process, the tree at ``base`` (imported in place of this
one) and this tree alternately, so both see the same load. Prints each run's planning
CPU seconds (``time.process_time``, capture apart), estimate and plan hash (notes,
timings and source paths left out), then per layer count the CPU ratio after/before and
the CPU each added layer costs (the slope between the first and last counts) before and
after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from in_tree import import_tree, plan_text

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one(root: str, layers: int, remat: str, k: int) -> dict:
    """Plan one candidate with the tree at ``root``; its figures."""
    os.environ["TORCHALPA_CACHE"] = "0"
    import_tree(root)
    import hashlib
    import time

    import torch

    import torchalpa
    import torchalpa.models as zoo
    from torchalpa.core.options import AutoShardingOption, ShardParallel
    from torchalpa.parallel.shard import blocks_of, candidate_meshes, plan_graph
    from torchalpa.parallel.workflow import capture_examples, capture_step, with_precision

    assert torchalpa.__file__.startswith(root), (torchalpa.__file__, root)
    w = zoo.llama3_8b().replace(num_layers=layers)
    with torch.device("meta"):
        model = w.build()
    batch = w.example_inputs(device="meta")
    model = with_precision(model, torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    captured = capture_step(model, capture_examples(model, batch, k), w.loss_fn)
    if remat != "none":
        from torchalpa.frontends.block_remat import checkpointed_capture
        captured = checkpointed_capture(captured, remat)
    graph = captured.graph
    method = ShardParallel(num_micro_batches=k, auto_sharding_option=AutoShardingOption(
        exact_below=0, free_followers_below=0))
    cpu = time.process_time()
    plan = plan_graph(graph, method=method,
                      meshes=candidate_meshes(torchalpa.Cluster.h100(1, 8), method),
                      blocks=blocks_of(graph), bound_views=False)
    cpu = time.process_time() - cpu
    text = plan_text(plan)
    return {"cpu": cpu, "est": plan.estimates.step_time_s, "nodes": len(graph),
            "mesh": list(plan.mesh_shape),
            "plan": hashlib.sha256(text.encode()).hexdigest()[:16]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", help="the tree before (a git archive of it)")
    p.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    p.add_argument("--remat", default="none")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--one", nargs=2, metavar=("ROOT", "LAYERS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(_one(os.path.abspath(args.one[0]), int(args.one[1]), args.remat,
                              args.micro_batches)))
        return
    runs: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.rounds):
        for layers in args.layers:
            for name, root in (("before", os.path.abspath(args.base)), ("after", HERE)):
                out = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), args.base, "--one", root,
                     str(layers), "--remat", args.remat, "--micro-batches",
                     str(args.micro_batches)], capture_output=True, text=True, check=True)
                run = json.loads(out.stdout.strip().splitlines()[-1])
                runs.setdefault((name, layers), []).append(run)
                print(f"{name:6s} {layers:3d} layers ({run['nodes']} nodes): {run['cpu']:6.1f} s "
                      f"CPU | est {run['est']!r} s/step, mesh {run['mesh']} | plan {run['plan']} "
                      f"| load {os.getloadavg()[0]:.1f}", flush=True)

    def mean(name, layers):
        return sum(r["cpu"] for r in runs[name, layers]) / len(runs[name, layers])

    for layers in args.layers:
        same = {r["plan"] for n in ("before", "after") for r in runs[n, layers]}
        print(f"{layers:3d} layers: CPU after/before {mean('after', layers) / mean('before', layers):.2f}x"
              f"; plans {'equal' if len(same) == 1 else 'DIFFER'}")
    lo, hi = min(args.layers), max(args.layers)
    if hi > lo:
        slope = {n: (mean(n, hi) - mean(n, lo)) / (hi - lo) for n in ("before", "after")}
        print(f"each layer {lo}->{hi}: before {slope['before']:.3f} s CPU, after "
              f"{slope['after']:.3f} s ({slope['after'] / slope['before']:.2f}x)")


if __name__ == "__main__":
    main()
