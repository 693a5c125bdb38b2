"""``pm.last_step_stats()``: what the last step measured, next to what the plan said.

The clock starts when a step starts (a call of the module, or ``train_step``) and stops
when its last part ends (backward for ``loss.backward()``, the optimizer step for
``train_step``). On CUDA it records events instead of synchronizing, so timing costs the
step nothing; ``last_step_stats()`` waits for the end event. Peak memory is the device's
``max_memory_allocated`` on CUDA, the process's peak resident set on a CPU.

Bytes: ``planned_*`` come from the plan's list of the collectives one step issues
(gradient buckets once, as they run); ``measured_*`` are what this rank's collectives
were really handed during the step (``runtime.measurement.traffic``: the sizes of the tensors passed
to each collective, per kind, and of what came back), so the two can be compared kind by
kind. ``measured_by_kind`` is ``{kind: (count, bytes sent)}``, as is ``planned_by_kind``;
a pipeline stage's sends to other stages count as ``send_recv``.

MFU is the captured step's flops (``plan.estimates["flops_per_step"]``: forward, backward
and optimizer of the global batch, recomputation included when the plan checkpoints) per
device per second, over the device's peak the plan was made for
(``peak_flops_per_device``: the cluster's default, bf16 tensor cores on an H100). It is
``None`` for plans without these figures (pipeline plans, plans cached before them).

Under ``torch.compile(pm)`` the clock stands still (reading a host clock inside a traced
step would break the graph): time the compiled call from outside instead.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field

import torch

from torchalpa.runtime.measurement.issued import issued_collectives
from torchalpa.runtime.measurement.traffic import TALLY, Traffic

__all__ = ["StepClock", "StepStats"]


@dataclass(frozen=True)
class StepStats:
    """One step, measured and as the plan estimated it (``None`` where unknown)."""

    step_time_s: float
    tokens: int
    tokens_per_s: float
    peak_memory_bytes: int
    peak_memory_kind: str              # "device (max_memory_allocated)" or "host RSS"
    planned_bytes_sent: int            # what the plan's collectives contribute per rank
    planned_collectives: int
    estimated_step_time_s: float | None
    estimated_memory_bytes: float | None
    includes: str                      # "forward+backward" or "forward+backward+optimizer"
    mfu: float | None = None           # flops_per_step / devices / step time / peak flop/s
    measured_bytes_sent: int = 0       # handed to this rank's collectives during the step
    measured_bytes_received: int = 0   # what those collectives gave back
    measured_collectives: int = 0
    measured_by_kind: dict = field(default_factory=dict)   # kind -> (count, bytes sent)
    planned_by_kind: dict = field(default_factory=dict)    # kind -> (count, bytes sent)

    def __str__(self) -> str:
        from torchalpa.core.units import format_bytes

        def est(v, f):
            return f"(plan: {f(v)})" if v is not None else "(plan: -)"
        return "\n".join([
            f"step ({self.includes}): {self.step_time_s * 1e3:.2f} ms "
            + est(self.estimated_step_time_s, lambda v: f"{v * 1e3:.2f} ms"),
            f"tokens/s: {self.tokens_per_s:,.0f} ({self.tokens} tokens)"
            + (f", MFU {self.mfu:.1%}" if self.mfu is not None else ""),
            f"peak memory, {self.peak_memory_kind}: {format_bytes(self.peak_memory_bytes)} "
            + est(self.estimated_memory_bytes, format_bytes),
            f"sent per rank: {format_bytes(self.measured_bytes_sent)} in "
            f"{self.measured_collectives} collectives, received "
            f"{format_bytes(self.measured_bytes_received)} (plan: "
            f"{format_bytes(self.planned_bytes_sent)} in {self.planned_collectives})"]
            + [f"  {kind}: {n} x, {format_bytes(b)} (plan: {pn} x, {format_bytes(pb)})"
               for kind in sorted(set(self.measured_by_kind) | set(self.planned_by_kind))
               for (n, b), (pn, pb) in [(self.measured_by_kind.get(kind, (0, 0)),
                                         self.planned_by_kind.get(kind, (0, 0)))]])


def _tokens(inputs) -> int:
    """Tokens of the batch: the elements of the first integer input (token ids), else the
    batch size of the first input."""
    for x in inputs:
        if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dim() >= 1:
            return int(x.numel())
    first = next((x for x in inputs if isinstance(x, torch.Tensor) and x.dim() >= 1), None)
    return int(first.shape[0]) if first is not None else 0


class StepClock:
    """Start/stop around a step; ``stats`` reads the last complete one."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._start = self._last = None
        self._tokens = 0
        self._traffic_start = Traffic()

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, inputs) -> None:
        if torch.compiler.is_compiling():   # under torch.compile(pm): no clock, no graph break
            return
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._start = self._mark()
        self._tokens = _tokens(inputs)
        self._traffic_start = TALLY.copy()

    def stop(self, includes: str) -> None:
        if torch.compiler.is_compiling() or self._start is None:
            return
        self._last = (self._start, self._mark(), self._tokens, includes,
                      TALLY.since(self._traffic_start))
        self._start = None

    def stats(self, plan, num_micro_batches: int = 1, *, loss_in_bucket=None,
              one_stage: bool = True) -> StepStats:
        """The last complete step; ``loss_in_bucket``: the gradient bucket its loss was
        all-reduced in (``runtime.rewrites.loss_in_bucket``; None: it had its own all-reduce);
        ``one_stage``: as ``issued_collectives`` takes it."""
        if self._last is None:
            raise ValueError("no step has completed yet: call the module and loss.backward(), "
                             "or train_step, before last_step_stats()")
        start, end, tokens, includes, traffic = self._last
        if self.cuda:
            assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            peak, kind = torch.cuda.max_memory_allocated(), "device (max_memory_allocated)"
        else:
            assert isinstance(start, float) and isinstance(end, float)
            seconds = end - start
            peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host RSS"
        est = plan.estimates
        issued = issued_collectives(plan, num_micro_batches,  # buckets once, as they run
                                    loss_in_bucket=loss_in_bucket, one_stage=one_stage)
        planned: dict[str, tuple[int, int]] = {}
        for c in issued:
            n, b = planned.get(c.kind, (0, 0))
            planned[c.kind] = (n + 1, b + c.bytes)
        return StepStats(
            step_time_s=seconds, tokens=tokens,
            tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
            peak_memory_bytes=int(peak), peak_memory_kind=kind,
            planned_bytes_sent=sum(c.bytes for c in issued),
            planned_collectives=len(issued),
            estimated_step_time_s=est.get("step_time_s"),
            estimated_memory_bytes=est.get("memory_per_device_bytes"), includes=includes,
            mfu=_mfu(est, plan.num_devices, seconds),
            measured_bytes_sent=sum(traffic.sent.values()),
            measured_bytes_received=sum(traffic.received.values()),
            measured_collectives=sum(traffic.count.values()),
            measured_by_kind={k: (traffic.count[k], traffic.sent[k]) for k in traffic.count},
            planned_by_kind=planned)


def _mfu(estimates: dict, num_devices: int, seconds: float) -> float | None:
    flops, peak = estimates.get("flops_per_step"), estimates.get("peak_flops_per_device")
    if not flops or not peak or seconds <= 0:
        return None
    return flops / num_devices / seconds / peak
