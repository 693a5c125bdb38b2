"""Plan a model from its ATen graph and from its StableHLO export; compare the plans.

    python benchmarks/stablehlo_crosscheck.py                     # mlp and gpt, 4 CPU devices
    python benchmarks/stablehlo_crosscheck.py --models mlp gpt bert llama --devices 8 --preset h100

The StableHLO comes from ``torchalpa.export_stablehlo`` (torch.export's joint graph through
torch-mlir). Both graphs are planned for the same cluster; the script prints how many
parameter placements agree and the ratio of the estimates (StableHLO / ATen). GPT's tied
output head is untied for both, since the export does not support tied parameters;
dropout is off (the two frontends would draw differently).
"""

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

import torchalpa
from torchalpa.cluster import Cluster


def workload(name: str):
    if name == "mlp":
        sys.path.insert(0, "examples")
        from quickstart import MLP
        torch.manual_seed(0)
        return MLP(512, 4), (torch.randn(512, 512), torch.randn(512, 512)), F.mse_loss
    from torchalpa import models
    w = models.tiny(name, **({"dropout": 0.0} if name in ("gpt", "bert") else {}))
    model = w.build()
    if name == "gpt":
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    return model, w.example_inputs(), w.loss_fn


def compare(name: str, cluster) -> dict:
    model, batch, loss_fn = workload(name)
    start = time.perf_counter()
    try:
        text = torchalpa.export_stablehlo(model, batch, loss_fn)
    except Exception as e:  # reported, then the next model
        return {"model": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    exported = time.perf_counter() - start
    from_aten = torchalpa.plan(model, batch, loss_fn, cluster=cluster)
    from_text = torchalpa.plan(text, (), cluster=cluster)
    differ = {p.name: [str(p.placements), str(from_text.parameter(p.name).placements)]
              for p in from_aten.parameters
              if p.placements != from_text.parameter(p.name).placements}
    keys = ("step_time_s", "compute_s", "communication_s", "memory_per_device_bytes")
    return {"model": name, "export_s": round(exported, 2),
            "mesh": [list(from_aten.mesh_shape), list(from_text.mesh_shape)],
            "parameters": len(from_aten.parameters),
            "same_placements": len(from_aten.parameters) - len(differ), "differ": differ,
            "ratio": {k: from_text.estimates[k] / from_aten.estimates[k] for k in keys},
            "unsupported_in_stablehlo": sorted({u["op"] for u in from_text.unsupported_ops})}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["mlp", "gpt"])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--preset", choices=["local_cpu", "h100"], default="local_cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cluster = Cluster.local_cpu(args.devices) if args.preset == "local_cpu" else \
        Cluster.h100(num_nodes=max(1, args.devices // 8), devices_per_node=min(8, args.devices))
    rows = [compare(name, cluster) for name in args.models]
    for r in rows:
        if "error" in r:
            print(f"{r['model']}: no StableHLO export: {r['error']}")
            continue
        ratios = ", ".join(f"{k} x{v:.3f}" for k, v in r["ratio"].items())
        print(f"{r['model']}: {r['same_placements']}/{r['parameters']} placements agree "
              f"(mesh {r['mesh'][0]} vs {r['mesh'][1]}); StableHLO/ATen: {ratios}")
        for fqn, (a, b) in r["differ"].items():
            print(f"    {fqn}: ATen {a}, StableHLO {b}")
        if r["unsupported_in_stablehlo"]:
            print(f"    replicated (no rule) in StableHLO: {r['unsupported_in_stablehlo']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
