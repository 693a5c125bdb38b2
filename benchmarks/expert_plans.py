"""Auto plans against the plans experts write by hand, under the same cost model.

    python benchmarks/expert_plans.py [--models 350m 1.3b 6.7b 13b] [--devices 8 64]

For GPT-3-shaped models (seq 1024) on clusters of 8-GPU H100 nodes, prints the estimated
step time of:
  - DP: DataParallel (every parameter replicated, the batch split);
  - ZeRO-3: Zero3Parallel (parameters, gradients, optimizer states sharded);
  - TP: Megatron tensor parallelism over all devices (attention QKV and MLP up columns,
    their output projections rows, everything else as the ILP likes);
  - every (dp, tp) grid point: batch split over dp, Megatron over tp within a node;
  - auto: torchalpa's own plan (every 1D/2D logical mesh, the ILP decides everything).
Hand-written plans are the same ILP with those layouts pinned, so each gets its best
completion; a plan that does not fit in 80 GB per device is reported as OOM. The last
columns check that auto is at most the best of them.
"""

import argparse
import time
from dataclasses import replace

import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel.shard import plan_graph
from torchalpa.passes.sharding.ilp import InfeasibleError

# hidden, layers, heads (GPT-3 paper sizes)
SIZES = {"350m": (1024, 24, 16), "1.3b": (2048, 24, 32), "2.7b": (2560, 32, 32),
         "6.7b": (4096, 32, 32), "13b": (5120, 40, 40)}


def megatron_pins(tp_axis: int, ndim: int, other: str = "R") -> dict:
    """Column- and row-parallel Linear layers of the zoo GPT on ``tp_axis``; ``other`` on
    the other axes ("R": replicated there, "*": the ILP's choice)."""
    def on(p):
        return tuple(p if a == tp_axis else other for a in range(ndim))
    # c_attn's output is split into q, k and v: Megatron's columns are each device's heads
    # of each of them, a strided shard of the fused weight (a contiguous quarter of 3H
    # would hold all of q and part of k: all-to-alls around attention)
    col, row, heads = on("S(0)"), on("S(1)"), on("S(0)/3")
    return {r"h\.\d+\.attn\.c_attn\.(weight|bias)": heads,
            r"h\.\d+\.mlp\.c_fc\.(weight|bias)": col,
            r"h\.\d+\.attn\.c_proj\.weight": row, r"h\.\d+\.mlp\.c_proj\.weight": row}


def baselines(n: int, per_node: int):
    yield "DP", torchalpa.DataParallel(logical_mesh_shape=(n,))
    yield "ZeRO-3", torchalpa.Zero3Parallel(logical_mesh_shape=(n,))
    yield "TP", torchalpa.ShardParallel(logical_mesh_shape=(n,), auto_sharding_option=(
        torchalpa.AutoShardingOption(pin=megatron_pins(0, 1))))
    tp = 2
    while tp <= min(per_node, n // 2):
        yield f"dp{n // tp}xtp{tp}", torchalpa.ShardParallel(
            logical_mesh_shape=(n // tp, tp), auto_sharding_option=torchalpa.AutoShardingOption(
                force_batch_dim_to_mesh_dim=0, pin=megatron_pins(1, 2)))
        tp *= 2


def step(graph, method, cluster) -> float:
    from torchalpa.parallel.shard import candidate_meshes
    try:
        return plan_graph(graph, method=method, meshes=candidate_meshes(cluster, method),
                          blocks=graph.meta.get("repeated_blocks")).estimates["step_time_s"]
    except InfeasibleError:
        return float("inf")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["350m", "1.3b", "6.7b", "13b"])
    p.add_argument("--devices", nargs="+", type=int, default=[8, 64])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--solver", default="highs")
    args = p.parse_args()
    option = torchalpa.AutoShardingOption(solver=args.solver)
    print(f"GPT, seq 1024, batch {args.batch}, H100 nodes of 8; estimated step time in ms "
          f"(OOM: no plan fits 80 GB); solver {args.solver}")
    worst_ratio = 0.0
    for name in args.models:
        hidden, layers, heads = SIZES[name]
        config = zoo.GPTConfig(vocab_size=51200, max_seq_len=1024, num_layers=layers,
                               num_heads=heads, hidden=hidden, dropout=0.0)
        workload = zoo.Workload("gpt", config, args.batch, 1024)
        with torch.device("meta"):
            model, batch = workload.build(), workload.example_inputs()
        graph = capture(model, batch, workload.loss_fn).graph
        for n in args.devices:
            cluster = torchalpa.Cluster.h100(num_nodes=max(1, n // 8),
                                             devices_per_node=min(8, n))
            start = time.perf_counter()
            rows = {}
            for label, method in baselines(n, cluster.devices_per_node):
                method = replace(method, auto_sharding_option=replace(
                    method.auto_sharding_option, solver=args.solver))
                rows[label] = step(graph, method, cluster)
            auto = step(graph, torchalpa.ShardParallel(auto_sharding_option=option), cluster)
            best_label = min(rows, key=rows.get)
            best = rows[best_label]
            if best == float("inf"):      # nothing fits: auto must say so too
                ratio_text = "both OOM" if auto == float("inf") else "only auto fits"
            else:
                ratio = auto / best
                worst_ratio = max(worst_ratio, ratio)
                ratio_text = f"auto/best {ratio:.3f}"
            cells = "  ".join(f"{k} {_ms(v)}" for k, v in rows.items())
            print(f"{name:>5} on {n:>2}: auto {_ms(auto)}  | {cells}  | best hand {best_label} "
                  f"{_ms(best)}  {ratio_text}  ({time.perf_counter() - start:.0f}s)",
                  flush=True)
    print(f"worst auto / best hand-written: {worst_ratio:.3f} (<= 1.0 means never worse)")


def _ms(seconds: float) -> str:
    return "OOM" if seconds == float("inf") else f"{seconds * 1e3:.0f}"


if __name__ == "__main__":
    main()
