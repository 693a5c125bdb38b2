"""``pm.profile(steps, path, *batch)``: a measured timeline of training steps, for Perfetto.

``plan.to_chrome_trace`` draws what the plan *estimates*; this records what a rank really
does, with ``torch.profiler`` (CPU activity, and CUDA kernels on a GPU), over ``steps``
training steps on the given batch, and writes it as a Chrome trace (open it in
https://ui.perfetto.dev or chrome://tracing). Labels (``runtime.measurement.traffic``) mark the plan's
parts in it:

- ``torchalpa::step <i>`` around each step;
- ``torchalpa::<kind> axis <a> (<name>) <bytes> B`` around each collective the plan issues
  (the same kind, mesh axis and bytes as the plan's rows), ``torchalpa::wait <kind>``
  where the rank waits for one -- so communication stands apart from compute;
- torch's own ``Optimizer.step#<name>.step`` around the optimizer step.

Each step is ``pm.train_step(*batch)`` when the module has an optimizer, else a forward
and ``loss.backward()`` (gradients accumulate). These are real steps: parameters change.
With several ranks each writes its own file: ``path`` may hold ``{rank}``; otherwise
``.rank<r>`` goes before its suffix (``trace.json`` -> ``trace.rank1.json``); rank 0 on a
single-rank job keeps ``path`` as given.
"""

from __future__ import annotations

import os

import torch
from torch.autograd.profiler import record_function

from torchalpa.runtime.execution.mesh import rank, world_size
from torchalpa.runtime.measurement.traffic import label_axes

__all__ = ["profile_steps", "trace_path"]


def trace_path(path: str | os.PathLike, rank: int, world_size: int) -> str:
    """Where rank ``rank`` writes: ``{rank}`` filled in, or ``.rank<r>`` before the suffix
    when the job has several ranks."""
    path = os.fspath(path)
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if world_size == 1:
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.rank{rank}{suffix}"


def profile_steps(pm, steps: int, path, inputs: tuple, kwargs: dict) -> str:
    """Run ``steps`` training steps of ``pm`` on ``inputs`` under ``torch.profiler`` and
    write this rank's Chrome trace; returns the file written."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"pm.profile(steps, path, *batch): steps must be a positive int, "
                         f"got {steps!r}")
    if not inputs and not kwargs:
        raise ValueError("pm.profile(steps, path, *batch) needs the batch to train on, as "
                         "train_step takes it: pm.profile(3, 'trace.json', x, y)")
    out = trace_path(path, rank(), world_size())
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    label_axes(pm.mesh)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(pm._device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    optimizer = getattr(pm, "optimizer", None)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(steps):
            with record_function(f"torchalpa::step {i}"):
                if optimizer is not None:
                    pm.train_step(*inputs, **kwargs)
                else:
                    loss = pm(*inputs, **kwargs)
                    getattr(loss, "loss", loss).backward()
    prof.export_chrome_trace(out)
    return out
