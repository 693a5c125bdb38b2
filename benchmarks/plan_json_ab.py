"""One intra-op plan of a few LLaMA-3-8B layers on every view of 1 x 8 H100, its time and
its plan JSON, to compare two commits' plans (equal but for source paths) back to back:

    git archive <commit> | tar -x -C /tmp/base
    python benchmarks/in_tree.py /tmp/base benchmarks/plan_json_ab.py 2 /tmp/before.json
    python benchmarks/plan_json_ab.py 2 /tmp/after.json
    diff <(sed 's|tmp/base/||' /tmp/before.json) /tmp/after.json

Arguments: layers (default 4), where to write the plan JSON (notes and timings left out).
"""

import hashlib
import json
import os
import sys
import time

os.environ["TORCHALPA_CACHE"] = "0"
import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import ShardParallel
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel.shard import blocks_of, candidate_meshes, plan_graph

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
w = zoo.llama3_8b(batch_size=8, seq_len=2048).replace(num_layers=layers)
with torch.device("meta"):
    model = w.build()
t = time.perf_counter()
graph = capture(model, w.example_inputs(device="meta"), w.loss_fn).graph
tc = time.perf_counter() - t
cluster = torchalpa.Cluster.h100(1, 8)
method = ShardParallel()
meshes = candidate_meshes(cluster, method)
t = time.perf_counter()
plan = plan_graph(graph, method=method, meshes=meshes, blocks=blocks_of(graph))
tp = time.perf_counter() - t
d = json.loads(plan.to_json())
for k in ("notes",):
    d.pop(k, None)
est = d.get("estimates", {})
for k in list(est):
    if "second" in k and k != "step_time_s":
        est.pop(k)
open(sys.argv[2], "w").write(json.dumps(d, sort_keys=True, indent=1))
digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
print(f"capture {tc:.1f}s plan {tp:.1f}s load {os.getloadavg()[0]:.1f} "
      f"est {plan.estimates.step_time_s!r} mesh {plan.mesh_shape} hash {digest}")
