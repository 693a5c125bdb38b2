"""The intra-op plan of the tests' meta tiny GPT on 4 H100s under budgets that bind: at
each fraction of the unbudgeted plan's memory, the plan's memory and step estimates and
the solve's seconds. What the ILP's memory rows allow shows here: rows above the estimate
push the plan to less memory (and a slower step) than the budget needs.

    python benchmarks/binding_budget.py 0.9 0.85 0.8

To compare with another commit, run it against that commit's copy (``git archive <commit>
| tar -x -C /tmp/base``) through ``benchmarks/in_tree.py /tmp/base benchmarks/binding_budget.py
...``: ``PYTHONPATH`` alone leaves the editable install's passes in place.
"""

import os
import sys
import time

os.environ["TORCHALPA_CACHE"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from search_models import meta_tiny_gpt  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.core.options import AutoShardingOption, ShardParallel  # noqa: E402
from torchalpa.frontends.torch_export import capture  # noqa: E402
from torchalpa.passes.sharding.intra_op import plan_intra_op  # noqa: E402

model, batch, loss_fn = meta_tiny_gpt()
graph = capture(model, batch, loss_fn).graph
mesh = torchalpa.Cluster.h100(1, 4).logical_mesh((4,))
free = plan_intra_op(graph, mesh, ShardParallel()).estimates
print(f"no budget: memory {free.memory_per_device_bytes:.0f} B, step {free.step_time_s:.6g} s")
for fraction in map(float, sys.argv[1:] or ["0.9", "0.85", "0.8"]):
    budget = fraction * free.memory_per_device_bytes
    start = time.perf_counter()
    plan = plan_intra_op(graph, mesh, ShardParallel(
        auto_sharding_option=AutoShardingOption(memory_budget_per_device=budget)))
    e = plan.estimates
    print(f"{fraction:.2f} x: budget {budget:.0f} B, memory {e.memory_per_device_bytes:.0f} B, "
          f"step {e.step_time_s:.6g} s, solved in {time.perf_counter() - start:.2f} s "
          f"(load {os.getloadavg()[0]:.1f})")
