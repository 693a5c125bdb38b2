"""The step's time with communication overlapped as the runtime overlaps it on GPUs.

On NCCL every collective a lowered program calls is split into an issue and a wait
(``runtime/overlap.py``): the functional collective runs on the process group's own CUDA
stream (one per mesh axis: each axis is a process group) while the compute stream goes
on, and the compute stream waits for it right before the first op that reads its result.
What that hides depends on where the program issues each collective, and the estimate
walks one micro-batch's ops in program order (forward, then backward) with one clock for
the compute stream and one per mesh axis for the communication streams:

- **serial** collectives (an activation's resharding, a tensor-parallel all-reduce, an
  op's own statistics): the lowering emits them right before the op that reads the
  result, so the compute stream waits for the whole collective (Megatron's tensor-parallel
  all-reduces are on the critical path too);
- **parameter gathers** (a sharded parameter's all-gather, ZeRO-3 / FSDP): the first of a
  program is issued before its reader; each next one right after the previous one was
  waited for (``overlap.prefetch_parameter_gathers``: FSDP2's prefetch, one parameter
  ahead), so it runs while the ops between the two readers compute. Forward and backward
  are separate programs: backward's first gather is not prefetched;
- **gradient reductions** of a one-stage step with one micro-batch
  (``runtime/reduce_in_backward.py``): packed into buckets in the order backward produces
  the gradients (the first bucket ``FIRST_BUCKET_BYTES``, then the mesh's
  ``gradient_bucket_bytes``, DDP's sizes) and each bucket issued as soon as its last
  gradient exists, so it runs while backward computes the earlier layers; the step ends
  when the last bucket is reduced. With several micro-batches (gradients are accumulated
  first) and in a pipeline stage (which reduces after its last backward) they run after
  backward, in full.

``overlapped_step`` returns the micro-batch's seconds with and without the gradients'
reductions. On CPU ranks (gloo) the collectives' threads share the cores the ops run on:
the estimate stays compute + communication there (``passes/sharding_plan.py`` does not
call this).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CommEvent", "overlapped_step", "FIRST_BUCKET_BYTES"]

FIRST_BUCKET_BYTES = 2 ** 20
"""DDP's first gradient bucket (``runtime/buckets.FIRST_BUCKET_BYTES``): reduction starts early."""


@dataclass(frozen=True, slots=True)
class CommEvent:
    """One collective of a micro-batch: its seconds, the op it belongs to (the reader it
    is waited for by, or for a gradient the op that produces it), the mesh axis whose
    stream runs it, and how it is issued: "serial", "gather" or "gradient"."""

    seconds: float
    op: int
    axis: int
    how: str
    bytes: float = 0.0
    phase: str = "forward"


@dataclass
class _Streams:
    """The compute clock and one communication clock per mesh axis."""

    t: float = 0.0
    comm: dict[int, float] = field(default_factory=dict)

    def issue(self, axis: int, seconds: float) -> float:
        """Queue a collective on ``axis``'s stream now; returns when it ends."""
        end = max(self.t, self.comm.get(axis, 0.0)) + seconds
        self.comm[axis] = end
        return end


def overlapped_step(compute_s: list[float], phases: list[str], events: list[CommEvent],
                    bucket_bytes: float) -> tuple[float, float]:
    """(seconds of one micro-batch with its gradient reductions overlapped with backward,
    seconds without any gradient reduction) for ops of ``compute_s`` seconds in program
    order, ``phases`` each op's phase, and the micro-batch's collectives ``events``."""
    without = _walk(compute_s, phases, [e for e in events if e.how != "gradient"], 0.0)
    with_grads = _walk(compute_s, phases, events, bucket_bytes) \
        if any(e.how == "gradient" for e in events) else without
    return with_grads, without


def _walk(compute_s: list[float], phases: list[str], events: list[CommEvent],
          bucket_bytes: float) -> float:
    by_op: dict[int, list[CommEvent]] = {}
    for e in events:
        by_op.setdefault(e.op, []).append(e)
    gathers = [e for e in sorted(events, key=lambda e: e.op) if e.how == "gather"]
    position = {id(e): j for j, e in enumerate(gathers)}
    ends: dict[int, float] = {}            # gather index -> when it is done
    s = _Streams()
    buckets: dict[int, list[float]] = {}   # axis -> [bytes, seconds] of the open bucket
    full_once: set[int] = set()            # axes whose first (small) bucket went out
    for i, seconds in enumerate(compute_s):
        here = by_op.get(i, ())
        mine = [position[id(e)] for e in here if e.how == "gather"]
        for j in mine:                     # issued before the reader unless prefetched
            if j not in ends:
                ends[j] = s.issue(gathers[j].axis, gathers[j].seconds)
        if mine:
            s.t = max([s.t] + [ends[j] for j in mine])
            nxt = max(mine) + 1            # prefetch: issued right after this wait
            if nxt < len(gathers) and nxt not in ends and gathers[nxt].phase == phases[i]:
                ends[nxt] = s.issue(gathers[nxt].axis, gathers[nxt].seconds)
        for e in here:
            if e.how == "serial":
                s.t = s.issue(e.axis, e.seconds)
        s.t += seconds
        for e in here:
            if e.how == "gradient":
                b = buckets.setdefault(e.axis, [0.0, 0.0])
                b[0] += e.bytes
                b[1] += e.seconds
                cap = bucket_bytes if e.axis in full_once else FIRST_BUCKET_BYTES
                if b[0] >= cap:
                    s.issue(e.axis, b[1])
                    full_once.add(e.axis)
                    buckets[e.axis] = [0.0, 0.0]
    for axis, (_, seconds) in buckets.items():
        if seconds:
            s.issue(axis, seconds)
    return max([s.t] + list(s.comm.values()))
