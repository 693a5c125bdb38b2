"""One training step's recorded order of collective issues, waits and matmuls on gloo
ranks, beside the order the step estimate assumes (tests/test_timeline_order.py).

Scenario ``zero3:<k>``: a 4-layer MLP without biases under ``Zero3Parallel`` with ``k``
micro-batches. After a first step (the programs are built), a second one runs under
``torch.profiler``; rank 0 lists, in start order, each "torchalpa::<kind> ..." issue label,
each "torchalpa::wait <kind>" label and each ``aten::mm``, for the parameters' all-gathers
and the gradients' reduce-scatters (the loss's all-reduce, which the step leaves in flight
until the loss is read, is left out: the estimate prices it where it is made), and the
order ``passes.sharding.sharding_plan.assumed_program_order`` gives for the same plan.

Scenario ``ddp:<k>``: the same MLP under ``DataParallel``, ``loss = pm(x, y);
loss.backward()``: the order of matmuls and all-reduces (the loss's issue told apart).

Scenario ``zero3-bf16:<k>``: the same under ``MixedPrecision(bfloat16)``: each parameter
is cast to bfloat16 (and transposed) before its gather (a cast gather).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from worker_io import run_scenarios  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.core.cluster import LogicalMesh  # noqa: E402
from torchalpa.frontends.torch_export import capture  # noqa: E402
from torchalpa.passes.sharding.sharding_plan import assumed_program_order  # noqa: E402
from torchalpa.runtime.execution.precision import CastForward  # noqa: E402

KINDS = ("all_gather", "reduce_scatter")
WIDTH = 512          # a weight is 1 MiB: the first gradient bucket closes after one


def model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH, bias=False), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _token(name: str, kinds: tuple[str, ...] = KINDS) -> str | None:
    if name in ("aten::mm", "aten::addmm"):
        return "mm"
    if not name.startswith("torchalpa::"):
        return None
    words = name.removeprefix("torchalpa::").split()
    if words[0] == "wait" and len(words) > 1 and words[1] in kinds:
        return f"wait {words[1]}"
    if words[0] in kinds:
        return f"issue {words[0]}"
    return None


def zero3(k: int, mixed_precision=None) -> dict:
    import torch.distributed as dist
    world = dist.get_world_size()
    torch.manual_seed(1)
    x, y = torch.randn(8 * world * k, WIDTH), torch.randn(8 * world * k, WIDTH)
    method = torchalpa.Zero3Parallel(logical_mesh_shape=(world,), num_micro_batches=k)
    pm = torchalpa.auto_parallel(model(), (x, y), F.mse_loss, method=method,
                                 mixed_precision=mixed_precision)
    pm(x, y).backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pm(x, y).backward()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    recorded = [t for t in (_token(e.name) for e in events) if t is not None]
    micro = tuple(t.shape[0] // k for t in (x, y))
    captured = model() if mixed_precision is None else CastForward(model(), mixed_precision)
    graph = capture(captured, (torch.randn(micro[0], WIDTH), torch.randn(micro[1], WIDTH)),
                    F.mse_loss, rematerialize_parameters=True).graph
    assumed = [t for t in assumed_program_order(graph, LogicalMesh(shape=tuple(pm.plan.mesh_shape)),
                                                pm.plan)
               if t in ("mm", "backward") or t.split()[1] in KINDS]
    return {"recorded": recorded, "assumed": assumed, "k": k,
            "same_graph": graph.fingerprint() == pm.plan.graph_fingerprint}


def ddp(k: int) -> dict:
    """The README's loop under a DDP plan: the recorded order of matmuls and all-reduces,
    the loss's issue (4 bytes) told apart as "issue loss"."""
    import torch.distributed as dist
    world = dist.get_world_size()
    torch.manual_seed(1)
    x, y = torch.randn(8 * world * k, WIDTH), torch.randn(8 * world * k, WIDTH)
    method = torchalpa.DataParallel(num_micro_batches=k)
    pm = torchalpa.auto_parallel(model(), (x, y), F.mse_loss, method=method)
    pm(x, y).backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = pm(x, y)
        kind = type(loss).__name__
        loss.backward()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    order = []
    for e in events:
        token = _token(e.name, ("all_reduce",))
        if token == "issue all_reduce" and e.name.endswith(" 4 B"):
            token = "issue loss"
        if token is not None:
            order.append(token)
    return {"order": order, "loss_type": kind}


def run(name: str, arg: str) -> dict:
    if name == "ddp":
        return ddp(int(arg))
    assert name in ("zero3", "zero3-bf16"), name
    if name == "zero3-bf16":
        return zero3(int(arg), torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    return zero3(int(arg))


def main() -> None:
    run_scenarios(run)


if __name__ == "__main__":
    main()
