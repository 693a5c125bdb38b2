"""``torchalpa.TensorBoardHook``: ``pm.last_step_stats()`` as TensorBoard scalars, per step.

    hook = torchalpa.TensorBoardHook("runs/exp1")      # or writer=an existing SummaryWriter
    for step, (x, y) in enumerate(batches):
        loss = pm.train_step(x, y)
        hook(pm, step, loss=loss)                       # rank 0 writes; the others only read
    hook.close()

Each call reads the last complete step and writes, under ``torchalpa/``: ``step_time_s``,
``tokens_per_s``, ``mfu`` (when the plan knows its flops and peak), ``peak_memory_bytes``,
``planned_bytes_sent``, ``planned_collectives``, ``bytes_sent`` and ``collectives`` (measured
at the collective wrappers), and the plan's estimates beside them as
``plan/step_time_s`` and ``plan/memory_bytes`` (so measured and estimated curves share a
chart group); ``loss=`` adds ``loss``. Writing uses ``torch.utils.tensorboard`` (the
``tensorboard`` package, an optional extra: ``pip install 'torchalpa[tensorboard]'``).

Only one rank writes (rank 0 by default): the stats are per rank and alike across ranks
of a step, and several writers into one directory would interleave event files.
"""

from __future__ import annotations

import os

import torch

from torchalpa.runtime.measurement.stats import StepStats

__all__ = ["TensorBoardHook", "step_scalars"]


def step_scalars(stats: StepStats) -> dict[str, float]:
    """The stats' numeric fields by TensorBoard tag (no prefix); unknown estimates left out."""
    scalars = {"step_time_s": stats.step_time_s, "tokens_per_s": stats.tokens_per_s,
               "peak_memory_bytes": float(stats.peak_memory_bytes),
               "planned_bytes_sent": float(stats.planned_bytes_sent),
               "planned_collectives": float(stats.planned_collectives),
               "bytes_sent": float(stats.measured_bytes_sent),
               "collectives": float(stats.measured_collectives)}
    if stats.mfu is not None:
        scalars["mfu"] = stats.mfu
    if stats.estimated_step_time_s is not None:
        scalars["plan/step_time_s"] = stats.estimated_step_time_s
    if stats.estimated_memory_bytes is not None:
        scalars["plan/memory_bytes"] = float(stats.estimated_memory_bytes)
    return scalars


def _summary_writer(log_dir):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError("torchalpa.TensorBoardHook writes through torch.utils.tensorboard, "
                          "which needs the tensorboard package: pip install tensorboard "
                          "(or pip install 'torchalpa[tensorboard]')") from e
    return SummaryWriter(log_dir=None if log_dir is None else os.fspath(log_dir))


class TensorBoardHook:
    """Call it after each step with the module and the step number (see the module doc)."""

    def __init__(self, log_dir: str | os.PathLike | None = None, *, writer=None,
                 prefix: str = "torchalpa", rank: int = 0):
        if log_dir is not None and writer is not None:
            raise ValueError("TensorBoardHook takes log_dir= or writer=, not both: the writer "
                             "already has its log directory")
        self.prefix, self.rank = prefix.rstrip("/"), rank
        self.writer = None
        if self._writes():
            self.writer = writer if writer is not None else _summary_writer(log_dir)

    def _writes(self) -> bool:
        from torchalpa.runtime.execution.mesh import rank
        return rank() == self.rank

    def __call__(self, pm, step: int, *, loss=None) -> StepStats:
        """Write the last complete step of ``pm`` at ``step``; returns its stats."""
        stats = pm.last_step_stats()
        if self.writer is None:
            return stats
        scalars = step_scalars(stats)
        if loss is not None:
            scalars["loss"] = float(loss.detach().item() if isinstance(loss, torch.Tensor)
                                    else loss)
        for tag, value in scalars.items():
            self.writer.add_scalar(f"{self.prefix}/{tag}", value, global_step=step)
        return stats

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def __enter__(self) -> TensorBoardHook:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
