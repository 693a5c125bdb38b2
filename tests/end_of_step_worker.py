"""Run by tests/test_memory_measured.py on 2 gloo ranks: a step whose peak is its end (the
optimizer step), measured on each rank beside the plan's estimate. Rank 0 writes JSON.

Scenarios ``dp:0`` (``DataParallel``: parameters whole on each rank, gradients all-reduced
in buckets), ``zero2:0`` (``Zero2Parallel``: parameters, states and gradients split over
the ranks, gradients reduce-scattered) and ``zero3:0`` (``Zero3Parallel``): a wide MLP (4
layers of width 1024 and 4096, 16.8 M parameters) on a global batch of 2, Adam, the
README's loop. An argument other than ``0``, ``WIDTHxLAYERSmMICRO`` (``512x8m1``), sets the
MLP's width and layers and the step's micro-batches (global batch 2 per micro-batch): a
narrow MLP of 8 layers packs several gradients into one bucket. Each rank records what
it holds before the step (its parameters' and optimizer states' local blocks, and the
flat buffers its gradient buckets keep between steps) plus the step's allocation peak
above that (``runtime/measurement/allocated.py``), and the plan's estimates."""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from worker_io import run_scenarios  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.runtime.measurement.allocated import peak_allocated  # noqa: E402
from torchalpa.runtime.rewrites.buckets import gradient_buckets  # noqa: E402
from torchalpa.runtime.rewrites.kept_buckets import KeptBucket  # noqa: E402

DIM = 1024


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _held_bytes(pm, before: set[int]) -> int:
    """Bytes of the distinct storages this rank holds between steps: parameters,
    optimizer states, the buffers its bucket buffers keep (not those of ``before``, an
    earlier scenario's)."""
    tensors = [_local(p) for p in pm.parameters()]
    for state in pm.optimizer.state.values():
        tensors += [_local(t) for t in state.values() if isinstance(t, torch.Tensor)]
    for kept in [o for o in gc.get_objects() if isinstance(o, KeptBucket)
                 and id(o) not in before]:
        tensors += kept.buffers
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
            if t.numel()}
    return sum(seen.values())


def adam_mlp(dim: int, num_layers: int, batch: int, **options):
    """The quickstart MLP (``num_layers`` layers ``dim`` wide) on ``batch`` random rows,
    wrapped by ``auto_parallel`` (with ``options``) with Adam: (module, x, y)."""
    from quickstart import MLP
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g)
    torch.manual_seed(0)
    pm = torchalpa.auto_parallel(MLP(dim, num_layers), (x, y), F.mse_loss,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4), **options)
    return pm, x, y


def warmed_step(pm, x, y):
    """The README's loop as one call, run twice (the optimizer states exist after), then
    the gradients freed and garbage collected: what a rank holds between steps is in
    place, and the step is ready to measure."""
    def step():
        pm.optimizer.zero_grad(set_to_none=True)
        pm(x, y).backward()
        pm.optimizer.step()

    for _ in range(2):
        step()
    pm.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    return step


def measured_step(method, dim: int = DIM, num_layers: int = 4) -> dict:
    before = {id(o) for o in gc.get_objects() if isinstance(o, KeptBucket)}
    pm, x, y = adam_mlp(dim, num_layers, 2 * method.num_micro_batches, method=method,
                        cluster=torchalpa.Cluster.local_cpu(dist.get_world_size()))
    step = warmed_step(pm, x, y)
    held = _held_bytes(pm, before)
    allocated = peak_allocated(step)
    peak = allocated.peak
    est = pm.plan.estimates
    out = {"held": held, "peak": peak, "measured": held + peak,
           "alive_at_peak": dict(list(allocated.alive_at_peak.items())[:4]),
           "estimate": est.memory_per_device_bytes,
           "end_of_step": est.end_of_step_bytes_per_device,
           "liveness_peak": est.model_state_bytes_per_device + est.activation_bytes_per_device,
           "buckets": [(b.kind, len(b.params), b.bytes) for b in gradient_buckets(pm.plan)],
           "largest": max(_local(p).numel() * _local(p).element_size()
                          for p in pm.parameters())}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    return {"ranks": gathered}


def run(name: str, arg: str) -> dict:
    methods = {"dp": torchalpa.DataParallel, "zero2": torchalpa.Zero2Parallel,
               "zero3": torchalpa.Zero3Parallel}
    if arg == "0":
        return measured_step(methods[name]())
    shape, micro = arg.split("m")
    dim, num_layers = (int(v) for v in shape.split("x"))
    return measured_step(methods[name](num_micro_batches=int(micro)), dim, num_layers)


def main() -> None:
    run_scenarios(run)


if __name__ == "__main__":
    main()
