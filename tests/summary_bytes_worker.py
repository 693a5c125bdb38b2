"""Run under torchrun inside ``netns_bytes.sh`` by tests/test_summary_bytes.py: for a plan of
one collective of each kind, what ``plan.summary()`` says each rank sends, next to what the
ranks put on loopback running that collective with the runtime's own calls. Rank 0 writes
``{kind: {"summary": bytes per rank, "loopback": bytes per rank, "text": the line}}`` as
JSON to argv[1]."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from torchalpa.core.plan import Collective, Plan
from torchalpa.runtime.execution import collectives as C
from torchalpa.runtime.measurement.measure import loopback_bytes
from torchalpa.views.report import wire_bytes

REPEAT = 4
ELEMENTS = 1 << 18          # 1 MiB of float32 contributed per rank


def one_collective_plan(kind: str, n: int, nbytes: int) -> Plan:
    c = Collective(kind=kind, axis=0, bytes=nbytes, phase="backward", source="layer",
                   tensor="x")
    return Plan(mesh_shape=(n,), axis_names=("data",), parameters=(), inputs=(),
                strategies=(), reshards=(), collectives=(c,))


def _gate() -> None:
    """Hold the other ranks until rank 0 has read the counter (it sends the go)."""
    dist.broadcast(torch.zeros(1), 0)


def _counted(work) -> int:
    """Loopback bytes from rank 0's reading before ``work`` to its reading after: no rank
    sends before the first reading or after the second."""
    dist.barrier()
    start = loopback_bytes()
    _gate()
    work()
    dist.barrier()
    end = loopback_bytes()
    _gate()
    return end - start


def measured(call) -> float:
    """Loopback bytes of one call, all ranks together (the gates' and barriers' own bytes
    taken out)."""
    call()

    def calls():
        for _ in range(REPEAT):
            call()
    return (_counted(calls) - _counted(lambda: None)) / REPEAT


def main() -> None:
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    group = init_device_mesh("cpu", (n,)).get_group(0).group_name
    x = torch.randn(ELEMENTS // (n * n) * (n * n))
    nbytes = x.numel() * x.element_size()
    calls = {"all_reduce": lambda: C.all_reduce(x, "sum", group),
             "all_gather": lambda: C.all_gather(x, 0, n, group),
             "reduce_scatter": lambda: C.reduce_scatter(x, 0, "sum", n, group),
             "all_to_all": lambda: C.all_to_all(x.view(n, -1), 0, 1, n, group)}
    out = {}
    for kind, call in calls.items():
        plan = one_collective_plan(kind, n, nbytes)
        text = next(line for line in plan.summary().splitlines() if "sent per rank" in line)
        out[kind] = {"summary": wire_bytes(plan, plan.collectives[0]),
                     "loopback": measured(call) / n, "text": text}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
