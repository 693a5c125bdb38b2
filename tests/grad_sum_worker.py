"""Run by tests/test_memory_measured.py on 4 gloo ranks: the gradient sums a pipelined
ZeRO step holds, measured, beside the plan's estimate. Rank 0 writes JSON.

Scenario ``zero_pipeline:0``: Alpa's quickstart MLP (4 layers of width 256 and 1024) in 2
stages of 2 ranks each, parameters split over each stage's 2 ranks (ZeRO-2), 4
micro-batches, 1F1B, Adam. Each rank records the bytes of the gradient sums its step
reduces (``StepRunner.gradients``' input, after the last backward), of its parameters
and optimizer states, and its stage's estimated model states."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from worker_io import run_scenarios  # noqa: E402

import torchalpa  # noqa: E402

DIM = 256


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, DIM, generator=g), torch.randn(32, DIM, generator=g)


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    seen = {}
    for t in tensors:
        storage = _local(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def zero_pipeline() -> dict:
    from quickstart import MLP
    x, y = _batch()
    torch.manual_seed(0)
    method = torchalpa.PipeshardParallel(
        num_micro_batches=4, layer_option=torchalpa.AutoLayerOption(layer_num=2),
        auto_sharding_option=torchalpa.AutoShardingOption(force_batch_dim_to_mesh_dim=0,
                                                          parameters="sharded"),
        stage_option=torchalpa.ManualStageOption(
            forward_stage_layer_ids=[[0], [1]], submesh_shapes=[(1, 2), (1, 2)]))
    pm = torchalpa.auto_parallel(MLP(DIM, 4), (x, y), F.mse_loss, method=method,
                                 cluster=torchalpa.Cluster.local_cpu(4),
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    sums: list[int] = []
    gradients = pm._runner.gradients

    def recorded(step, *args, **kwargs):
        sums.append(_storage_bytes(step.raw))
        return gradients(step, *args, **kwargs)
    pm._runner.gradients = recorded
    for _ in range(2):
        pm(x, y).backward()
        pm.optimizer.step()
        pm.optimizer.zero_grad(set_to_none=True)
    rank = dist.get_rank()
    stage = next(s for s in pm.plan.stages if rank in s.ranks)
    params = [p for p in pm.parameters() if _local(p).numel()]
    states = [t for s in pm.optimizer.state.values() for t in s.values()
              if isinstance(t, torch.Tensor) and t.dim() > 0]
    out = {"stage": stage.index, "sums": sums[-1], "params": _storage_bytes(params),
           "optimizer_states": _storage_bytes(states),
           "estimated_state": stage.plan.estimates.model_state_bytes_per_device}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    return {"ranks": gathered}


def run(name: str, arg: str) -> dict:
    del arg
    return {"zero_pipeline": zero_pipeline}[name]()


def main() -> None:
    run_scenarios(run)


if __name__ == "__main__":
    main()
