"""Run by tests/test_traffic.py on real gloo ranks: the bytes ``pm.last_step_stats()``
measures at the collective wrappers, and ``pm.profile``'s labelled timeline, against the
plan's list of collectives. Rank 0 writes what it saw as JSON to argv[1]; argv[2] is a
directory for the traces."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from quickstart import MLP as QuickstartMLP  # noqa: E402
from worker_io import attempt, finish  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.runtime.execution.mesh import init_distributed  # noqa: E402
from torchalpa.runtime.measurement.comm_count import CollectiveCounter  # noqa: E402
from torchalpa.runtime.measurement.issued import issued_collectives  # noqa: E402


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)


def by_kind(collectives) -> dict:
    out: dict = {}
    for kind, nbytes in collectives:
        n, b = out.get(kind, (0, 0))
        out[kind] = [n + 1, b + nbytes]
    return out


def measured_bytes(method) -> dict:
    """Three steps (train_step twice, then pm(x, y).backward()): per step the stats' bytes
    per kind, the dispatcher's count of the same step, and the plan's list."""
    torch.manual_seed(0)
    x, y = batch(0)
    pm = torchalpa.auto_parallel(QuickstartMLP(64, 2), (x, y), F.mse_loss, method=method,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    out = {"planned": by_kind((c.kind, c.bytes) for c in issued_collectives(pm.plan)),
           "steps": []}
    for step in range(3):
        x, y = batch(step)
        with CollectiveCounter.for_mesh(pm.mesh) as counter:
            if step < 2:
                pm.train_step(x, y)
            else:
                pm(x, y).backward()
        stats = pm.last_step_stats()
        out["steps"].append({
            "measured": {k: list(v) for k, v in stats.measured_by_kind.items()},
            "stats_planned": {k: list(v) for k, v in stats.planned_by_kind.items()},
            "dispatched": by_kind((r.kind, r.bytes) for r in counter.records),
            "planned": by_kind((c.kind, c.bytes) for c in pm.collectives_per_step(
                train_step=step < 2)),
            "sent": stats.measured_bytes_sent, "received": stats.measured_bytes_received,
            "count": stats.measured_collectives, "text": str(stats)})
    return out


def profile(shared: str) -> dict:
    """Two profiled steps: the torchalpa labels in this rank's trace and the plan's rows."""
    torch.manual_seed(0)
    x, y = batch(0)
    pm = torchalpa.auto_parallel(QuickstartMLP(64, 2), (x, y), F.mse_loss,
                                 method=torchalpa.Zero3Parallel(),
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    written = pm.profile(2, os.path.join(shared, "trace.json"), x, y)
    with open(written) as f:
        trace = json.load(f)           # the test's first check: it is valid JSON
    names = sorted({e.get("name", "") for e in trace["traceEvents"]
                    if e.get("name", "").startswith("torchalpa::")})
    return {"written": os.path.basename(written), "labels": names,
            "planned": sorted({(c.kind, c.axis, c.bytes)
                               for c in issued_collectives(pm.plan)}),
            "axis_names": list(pm.mesh.mesh_dim_names or ())}


def main():
    out_path, shared = sys.argv[1], sys.argv[2]
    init_distributed()
    results: dict = {"world_size": dist.get_world_size(), "rank": dist.get_rank()}
    results["zero3"] = attempt(lambda: measured_bytes(torchalpa.Zero3Parallel()))
    results["data_parallel"] = attempt(lambda: measured_bytes(torchalpa.DataParallel()))
    results["profile"] = attempt(lambda: profile(shared))
    finish(results, out_path)


if __name__ == "__main__":
    main()
