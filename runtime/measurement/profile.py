"""Time layers on this job's devices, for ``PipeshardParallel(stage_option="profile")``.

Alpa profiles candidate stages on the cluster instead of trusting a cost model. Here each
``LayerProbe`` (one distinct layer on one submesh view, see ``passes/pipeline_search/inter_op.py``) is
lowered exactly as the pipeline runtime lowers a stage, run on the first ranks of the
world arranged as that view -- real local ops, real collectives inside the submesh -- on
the user's example micro-batch, with random values for the activations and gradients the
stage would receive. Its forward plus backward time (the slowest member rank, median of a
few repetitions) is what the stage DP then uses for that layer.

Every rank of the job calls ``profile_layers`` with the same probes (creating each
probe's process groups takes all ranks); ranks outside a probe's submesh wait for it.
"""

from __future__ import annotations

import logging
import math
import statistics
import time

import torch
import torch.distributed as dist

from torchalpa.core.placement import local_shape

__all__ = ["profile_layers"]

log = logging.getLogger("torchalpa")


def profile_layers(captured, probes, micro_inputs, model, device, *, repeats: int = 3
                   ) -> dict[tuple, float]:
    """Seconds per micro-batch (forward + backward) of every probe, on every rank."""
    from torch.distributed.device_mesh import DeviceMesh

    from torchalpa.runtime.execution.pipeline import lower_stage

    rank = dist.get_rank()
    tensors = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    measured = {}
    meshes: dict[tuple, DeviceMesh] = {}     # process groups are made once per view, not
    groups: dict[int, object] = {}          # once per probe (every rank takes part)
    start = time.perf_counter()
    for probe in probes:
        view = probe.key[1]
        size = math.prod(view)
        splan = probe.plan.stages[probe.stage].plan
        names = tuple(splan.axis_names)
        if (view, names) not in meshes:
            meshes[(view, names)] = DeviceMesh(device.type, torch.arange(size).reshape(view),
                                               mesh_dim_names=names)
        if size not in groups:
            groups[size] = dist.new_group(list(range(size))) if size > 1 else None
        mesh, together = meshes[(view, names)], groups[size]
        seconds = torch.zeros((), dtype=torch.float64, device=device)
        if rank < size:
            program = lower_stage(
                captured.gm, probe.plan, probe.stage, param_names=captured.param_names,
                buffer_names=captured.buffer_names, buffer_updates=captured.buffer_updates,
                coords=mesh.get_coordinate(),
                group_names=[mesh.get_group(i).group_name for i in range(mesh.ndim)],
                device=device)
            seconds.fill_(_time_stage(program, splan, probe.plan, captured, micro_inputs,
                                      tensors, together, device, repeats))
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        measured[probe.key] = seconds.item()
    log.info("profiled %d layer probes in %.1fs", len(probes), time.perf_counter() - start)
    return measured


def _time_stage(program, splan, pplan, captured, micro_inputs, tensors, together, device,
                repeats: int) -> float:
    from torchalpa.runtime.execution.pipeline import transfer_specs
    placements = {p.name: p for p in splan.parameters}
    state = []
    for name in program.params + program.buffers:
        p = placements[name]
        shape = local_shape(tuple(p.shape), p.placements, splan.mesh_shape)
        state.append(_random(shape, tensors[name].dtype, device))
    inputs = [micro_inputs[i].to(device) for i in program.user_inputs]
    specs = transfer_specs(captured.gm, pplan)
    forward_recvs = [_random(*specs[k], device) for k in program.forward_recvs]
    backward_recvs = [_random(*specs[k], device) for k in program.backward_recvs]
    times = []
    for _ in range(repeats + 1):             # the first run warms up
        if together is not None:   # line the ranks up: time the collectives, not waits
            dist.barrier(group=together)
        begin = time.perf_counter()
        out = list(program.forward(*state, *inputs, *forward_recvs))
        n_out = int(program.has_loss) + len(program.forward_sends) + len(program.buffer_updates)
        program.backward(*out[n_out:], *backward_recvs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - begin)
    return statistics.median(times[1:])


def _random(shape, dtype, device) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)
