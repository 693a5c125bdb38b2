"""Plan a model from its ATen graph and from its StableHLO export; compare the plans.

    python benchmarks/stablehlo_crosscheck.py                     # mlp and gpt, 4 CPU devices
    python benchmarks/stablehlo_crosscheck.py --models mlp gpt bert llama --devices 8 --preset h100
    python benchmarks/stablehlo_crosscheck.py --models gpt --mesh 4 --detail   # one mesh, why
    python benchmarks/stablehlo_crosscheck.py --models mlp gpt bert llama --mesh 4 --size small

``--mesh 2x2`` plans one logical mesh instead of trying every view of the cluster (the 2D
solve is minutes on a loaded 2-core machine); ``--detail`` prints where the two plans
differ: per op kind the ops, flops and bytes of each graph, and per (phase, kind) the
collectives and their bytes. ``--why`` plans each graph again with every parameter pinned
to the other frontend's placement: a tie costs the same, a real preference more.

The StableHLO comes from ``torchalpa.export_stablehlo`` (torch.export's joint graph through
torch-mlir). Both graphs are planned for the same cluster; the script prints how many
parameter placements agree and the ratio of the estimates (StableHLO / ATen). GPT keeps its
tied output head (the export passes a tied parameter once, under its first name); dropout
is off (the two frontends would draw differently).

XLA fuses the StableHLO program's elementwise chains, so by default the ATen graph is
priced as ``torch.compile`` runs it (``AutoShardingOption(elementwise="fused")``,
``passes/pricing/fused_pricing.py``): the same executions compared. ``--elementwise eager``
prices ATen op by op (the runtime without ``compile``); each row also gives the eager
step ratio. Likewise attention: torch-mlir's export writes it as two batched matmuls
around a softmax, whose (B, heads, L, L) scores XLA on a CPU writes, while the ATen capture
records one fused op that never stores them. ``--attention products`` (default) captures
the ATen side's attention as PyTorch's math SDPA writes it (``attention_as_products`` in
``frontends/opset.py``), the execution the StableHLO program describes; ``--attention
fused`` keeps the fused op (then BERT's estimates differ by that execution difference).
"""

import argparse
import contextlib
import json
import re
import sys
import time

import torch
import torch.nn.functional as F

import torchalpa
from torchalpa.core.cluster import Cluster
from torchalpa.core.options import AutoShardingOption, ShardParallel
from torchalpa.frontends.opset import attention_as_products

# ``--size small``: the zoo's configs at width 256, batch 8 x 128 tokens, where a layout is
# a decision (megabytes moved) rather than a few kilobytes whose collectives cost their
# latency alone, so two plans within 0.2% of each other are real ties (docs/stablehlo-jax.md)
SMALL = {
    "gpt": dict(hidden=256, num_heads=8, num_layers=2, vocab_size=1024, max_seq_len=128),
    "llama": dict(hidden=256, num_heads=8, num_kv_heads=4, intermediate=512, num_layers=2,
                  vocab_size=1024, max_seq_len=128),
    "bert": dict(hidden=256, num_heads=8, intermediate=1024, num_layers=2, vocab_size=1024,
                 max_seq_len=128),
}


def workload(name: str, size: str = "tiny"):
    if name == "mlp":       # the quickstart's own sizes at either setting
        sys.path.insert(0, "examples")
        from quickstart import MLP
        torch.manual_seed(0)
        return MLP(512, 4), (torch.randn(512, 512), torch.randn(512, 512)), F.mse_loss
    from torchalpa import models
    config = {"dropout": 0.0} if name in ("gpt", "bert") else {}
    if size == "small":
        config.update(SMALL[name])
    w = models.tiny(name, **config)
    if size == "small":
        w = w.replace(batch_size=8, seq_len=128)
    return w.build(), w.example_inputs(), w.loss_fn


def _op_table(graph) -> dict[str, list[float]]:
    """Per op kind: [ops, flops, bytes] of an OpGraph (views move no bytes)."""
    table: dict[str, list[float]] = {}
    for node in graph.ops():
        row = table.setdefault(node.op, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += node.flops
        row[2] += node.bytes
    return table


def _collective_table(plan) -> dict[str, list[int]]:
    """Per "phase kind axis": [collectives, bytes] of a plan."""
    table: dict[str, list[int]] = {}
    for c in plan.collectives:
        row = table.setdefault(f"{c.phase} {c.kind} axis{c.axis}", [0, 0])
        row[0] += 1
        row[1] += c.bytes
    return table


def detail(graph_aten, graph_text, from_aten, from_text) -> dict:
    """Where the two plans differ: op kinds (count, flops, bytes) and collectives."""
    ops_a, ops_t = _op_table(graph_aten), _op_table(graph_text)
    coll_a, coll_t = _collective_table(from_aten), _collective_table(from_text)
    return {"ops": {k: [ops_a.get(k, [0, 0.0, 0.0]), ops_t.get(k, [0, 0.0, 0.0])]
                    for k in sorted(set(ops_a) | set(ops_t))},
            "collectives": {k: [coll_a.get(k, [0, 0]), coll_t.get(k, [0, 0])]
                            for k in sorted(set(coll_a) | set(coll_t))}}


def aten_method(elementwise: str = "fused", pin: tuple = ()) -> ShardParallel:
    """The method the ATen graph is planned with: elementwise chains priced ``elementwise``."""
    return ShardParallel(auto_sharding_option=AutoShardingOption(elementwise=elementwise,
                                                                 pin=pin))


def pinned_to(plan, elementwise: str = "fused") -> ShardParallel:
    """A method that plans with every parameter held at ``plan``'s placement."""
    pins = tuple(("^" + re.escape(p.name) + "$", tuple(p.placements)) for p in plan.parameters)
    return aten_method(elementwise, pins)


def preferences(model, batch, loss_fn, text, from_aten, from_text, cluster,
                elementwise: str = "fused") -> dict:
    """Whether differing placements are a tie or a real preference: each frontend's plan
    objective with its own placements and with the other frontend's (every parameter
    pinned there, the rest planned again). Own < other's in both: each cost model really
    prefers its own layout; equal in one: a tie that frontend broke the other way."""
    aten_other = torchalpa.plan(model, batch, loss_fn, cluster=cluster,
                                method=pinned_to(from_text, elementwise))
    text_other = torchalpa.plan(text, (), cluster=cluster, method=pinned_to(from_aten))
    return {"aten": [from_aten.estimates["objective"], aten_other.estimates["objective"]],
            "stablehlo": [from_text.estimates["objective"], text_other.estimates["objective"]]}


def compare(name: str, cluster, want_detail: bool = False, why: bool = False,
            elementwise: str = "fused", size: str = "tiny", attention: str = "products"
            ) -> dict:
    with (attention_as_products() if attention == "products" else contextlib.nullcontext()):
        return _compare(name, cluster, want_detail, why, elementwise, size)


def _compare(name: str, cluster, want_detail: bool, why: bool, elementwise: str,
             size: str) -> dict:
    model, batch, loss_fn = workload(name, size)
    start = time.perf_counter()
    try:
        text = torchalpa.export_stablehlo(model, batch, loss_fn)
    except Exception as e:  # reported, then the next model
        return {"model": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    exported = time.perf_counter() - start
    from_aten = torchalpa.plan(model, batch, loss_fn, cluster=cluster,
                               method=aten_method(elementwise))
    eager = from_aten if elementwise == "eager" else torchalpa.plan(
        model, batch, loss_fn, cluster=cluster, method=aten_method("eager"))
    from_text = torchalpa.plan(text, (), cluster=cluster)
    extra = {}
    if want_detail:
        from torchalpa.interop.programs import program_graph
        from torchalpa.parallel.workflow import capture_step
        from torchalpa.passes.pricing.fused_pricing import priced_as
        extra["detail"] = detail(priced_as(capture_step(model, batch, loss_fn).graph,
                                           elementwise),
                                 program_graph(text, ()), from_aten, from_text)
    text_params = {p.name: p for p in from_text.parameters}
    differ = {p.name: [str(p.placements), str(text_params[p.name].placements)
                       if p.name in text_params else "absent"]
              for p in from_aten.parameters
              if p.name not in text_params or p.placements != text_params[p.name].placements}
    keys = ("step_time_s", "compute_s", "communication_s", "memory_per_device_bytes")
    if why and differ:
        extra["preferences"] = preferences(model, batch, loss_fn, text, from_aten, from_text,
                                           cluster, elementwise)
    return {"model": name, "export_s": round(exported, 2),
            "mesh": [list(from_aten.mesh_shape), list(from_text.mesh_shape)],
            "parameters": len(from_aten.parameters),
            "same_placements": len(from_aten.parameters) - len(differ), "differ": differ,
            "ratio": {k: from_text.estimates[k] / from_aten.estimates[k] for k in keys},
            "eager_step_ratio": from_text.estimates["step_time_s"]
            / eager.estimates["step_time_s"],
            "unsupported_in_stablehlo": sorted({u["op"] for u in from_text.unsupported_ops}),
            **extra}


def _print_detail(d: dict) -> None:
    print("    op kind: ATen ops/flops/bytes | StableHLO ops/flops/bytes (differing only)")
    for op, (a, t) in d["ops"].items():
        if a != t:
            print(f"      {op:42s} {a[0]:4.0f} {a[1]:9.3g} {a[2]:9.3g} | "
                  f"{t[0]:4.0f} {t[1]:9.3g} {t[2]:9.3g}")
    print("    collectives: ATen count/bytes | StableHLO count/bytes")
    for key, (a, t) in d["collectives"].items():
        mark = "" if a == t else "   <- differs"
        print(f"      {key:36s} {a[0]:4d} {a[1]:10d} | {t[0]:4d} {t[1]:10d}{mark}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["mlp", "gpt"])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--preset", choices=["local_cpu", "h100"], default="local_cpu")
    p.add_argument("--mesh", default=None, help="one logical mesh, e.g. 4 or 2x2")
    p.add_argument("--detail", action="store_true", help="print per op kind and collective")
    p.add_argument("--why", action="store_true",
                   help="where placements differ, plan each graph pinned to the other's")
    p.add_argument("--elementwise", choices=["fused", "eager"], default="fused",
                   help="how the ATen graph's elementwise chains are priced")
    p.add_argument("--attention", choices=["products", "fused"], default="products",
                   help="how the ATen side captures attention (the StableHLO export has "
                   "two batched matmuls around a softmax)")
    p.add_argument("--size", choices=["tiny", "small"], default="tiny",
                   help="the zoo's tiny configs, or width 256 at batch 8 x 128 (SMALL)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cluster = Cluster.local_cpu(args.devices) if args.preset == "local_cpu" else \
        Cluster.h100(num_nodes=max(1, args.devices // 8), devices_per_node=min(8, args.devices))
    if args.mesh:
        cluster = cluster.logical_mesh(tuple(int(n) for n in args.mesh.split("x")))
    rows = [compare(name, cluster, args.detail, args.why, args.elementwise, args.size,
                    args.attention)
            for name in args.models]
    for r in rows:
        if "error" in r:
            print(f"{r['model']}: no StableHLO export: {r['error']}")
            continue
        ratios = ", ".join(f"{k} x{v:.3f}" for k, v in r["ratio"].items())
        print(f"{r['model']}: {r['same_placements']}/{r['parameters']} placements agree "
              f"(mesh {r['mesh'][0]} vs {r['mesh'][1]}); StableHLO/ATen ({args.elementwise}): "
              f"{ratios}; step vs eager ATen x{r['eager_step_ratio']:.3f}")
        for fqn, (a, b) in r["differ"].items():
            print(f"    {fqn}: ATen {a}, StableHLO {b}")
        for side, (own, other) in r.get("preferences", {}).items():
            print(f"    {side} objective: own placements {own * 1e3:.4f} ms, the other "
                  f"frontend's {other * 1e3:.4f} ms ({(other / own - 1) * 100:+.3f}%)")
        if r["unsupported_in_stablehlo"]:
            print(f"    replicated (no rule) in StableHLO: {r['unsupported_in_stablehlo']}")
        if "detail" in r:
            _print_detail(r["detail"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
