"""The step's time with communication overlapped as the runtime overlaps it on GPUs.

On NCCL every collective a lowered program calls is split into an issue and a wait
(``runtime/rewrites/overlap.py``): the functional collective runs on the process group's own CUDA
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
  (``runtime/rewrites/reduce_in_backward.py``): packed into buckets in the order backward produces
  the gradients (the first bucket ``FIRST_BUCKET_BYTES``, then the mesh's
  ``gradient_bucket_bytes``, DDP's sizes) and each bucket issued as soon as its last
  gradient exists, so it runs while backward computes the earlier layers; the step ends
  when the last bucket is reduced. With several micro-batches (gradients are accumulated
  first) and in a pipeline stage (which reduces after its last backward) they run after
  backward, in full.

Two things the device does not do alone shape the same walk:

- **the host** (``host_s``, eager programs: ``LogicalMesh.host_op_s``): Python issues
  every op, views too, one after the other; a kernel starts when the device is free *and*
  the host has issued it (a queue: the host runs ahead of a busy device, a device waits
  on a slow host). A step of many small kernels costs the host's time, one of large
  kernels the device's; in between, each stretch costs the slower of the two;
- **contention** (``contention``, ``LogicalMesh.contention``): a collective's kernel
  beside compute takes SMs and memory bandwidth from it, so compute that runs while a
  communication stream is busy goes ``contention`` times slower. Overlapped communication
  is not free: it costs ``contention - 1`` of the compute it overlaps.

``overlapped_step`` returns the micro-batch's seconds with and without the gradients'
reductions. On CPU ranks (gloo) the collectives' threads share the cores the ops run on:
the estimate stays compute + communication there (``passes/sharding/sharding_plan.py`` does not
call this).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

__all__ = ["CommEvent", "Device", "overlapped_step", "FIRST_BUCKET_BYTES"]

FIRST_BUCKET_BYTES = 2 ** 20
"""DDP's first gradient bucket (``runtime/rewrites/buckets.FIRST_BUCKET_BYTES``): reduction starts early."""


@dataclass(frozen=True, slots=True)
class CommEvent:
    """One collective of a micro-batch: its seconds, the op it belongs to (the reader it
    is waited for by, or for a gradient the op that produces it), the mesh axis whose
    stream runs it, and how it is issued: "serial", "gather" or "gradient"; ``kind``: the
    collective (all_gather, reduce_scatter, ...) for ``program_order``."""

    seconds: float
    op: int
    axis: int
    how: str
    bytes: float = 0.0
    phase: str = "forward"
    kind: str = ""


@dataclass
class _Streams:
    """The compute clock, one communication clock per mesh axis, and (when ``trace`` is a
    list) the order of issues, waits and ops the walk assumes."""

    t: float = 0.0
    comm: dict[int, float] = field(default_factory=dict)
    trace: list[str] | None = None

    def issue(self, event: CommEvent, seconds: float) -> float:
        """Queue a collective on ``event.axis``'s stream now; returns when it ends."""
        axis = event.axis
        end = max(self.t, self.comm.get(axis, 0.0)) + seconds
        self.comm[axis] = end
        self.note(f"issue {event.kind}")
        return end

    def run(self, seconds: float, contention: float) -> None:
        """Run ``seconds`` of compute from now: ``contention`` times slower while a
        communication stream is still busy."""
        busy = max(self.comm.values(), default=0.0) - self.t
        if contention > 1.0 and busy > 0 and seconds > 0:
            slowed = min(seconds * contention, busy)    # wall time under contention
            self.t += slowed + (seconds - slowed / contention)
        else:
            self.t += seconds

    def note(self, what: str) -> None:
        if self.trace is not None:
            self.trace.append(what)


@dataclass(frozen=True, slots=True)
class Device:
    """What the walk knows of the device besides its ops' kernel seconds: the host seconds
    to issue each op (empty: the host keeps ahead, not modeled) and the factor compute
    slows by while a collective runs beside it (1.0: no contention)."""

    host_s: tuple[float, ...] = ()
    contention: float = 1.0


def overlapped_step(compute_s: list[float], phases: list[str], events: list[CommEvent],
                    bucket_bytes: float, device: Device = Device()) -> tuple[float, float]:
    """(seconds of one micro-batch with its gradient reductions overlapped with backward,
    seconds without any gradient reduction) for ops of ``compute_s`` kernel seconds in
    program order, ``phases`` each op's phase, the micro-batch's collectives ``events``,
    and ``device``'s host issue times and contention (module doc)."""
    if device.host_s and len(device.host_s) != len(compute_s):
        raise ValueError(f"overlapped_step: {len(device.host_s)} host times for "
                         f"{len(compute_s)} ops; give one per op (or none)")
    without = _walk(compute_s, phases, [e for e in events if e.how != "gradient"], 0.0,
                    device=device)
    with_grads = _walk(compute_s, phases, events, bucket_bytes, device=device) \
        if any(e.how == "gradient" for e in events) else without
    return with_grads, without


def program_order(ops: list[str | None], phases: list[str], events: list[CommEvent],
                  bucket_bytes: float) -> list[str]:
    """The order of one micro-batch's issues, waits and ops that the estimate assumes
    (``overlapped_step``'s walk): "issue <kind>", "wait <kind>", each op's name in ``ops``
    (None: not listed), and "backward" where backward begins, for a test to hold against
    a recorded step."""
    trace: list[str] = []
    _walk([0.0] * len(ops), phases, events, bucket_bytes, trace, ops)
    return trace


def _buckets(gradients: list[CommEvent], bucket_bytes: float) -> list[CommEvent]:
    """The gradients' reductions as the runtime issues them (``runtime/rewrites/buckets.py``): per
    mesh axis, in the order backward makes them, packed into buckets of at most a cap (the
    first ``FIRST_BUCKET_BYTES``, then ``bucket_bytes``), each bucket one collective
    issued once its last gradient exists (at that gradient's op)."""
    out: list[CommEvent] = []
    by_axis: dict[int, list[CommEvent]] = {}
    for e in sorted(gradients, key=lambda e: e.op):
        by_axis.setdefault(e.axis, []).append(e)
    for members in by_axis.values():
        cap, bucket = FIRST_BUCKET_BYTES, []
        for e in members + [None]:
            if bucket and (e is None or sum(b.bytes for b in bucket) + e.bytes > cap):
                out.append(replace(bucket[-1], seconds=sum(b.seconds for b in bucket),
                                   bytes=sum(b.bytes for b in bucket)))
                cap, bucket = bucket_bytes, []
            if e is not None:
                bucket.append(e)
    return out


def _walk(compute_s: list[float], phases: list[str], events: list[CommEvent],
          bucket_bytes: float, trace: list[str] | None = None,
          names: list[str | None] | None = None, device: Device = Device()) -> float:
    by_op: dict[int, list[CommEvent]] = {}
    for e in events:
        by_op.setdefault(e.op, []).append(e)
    gathers = [e for e in sorted(events, key=lambda e: e.op) if e.how == "gather"]
    position = {id(e): j for j, e in enumerate(gathers)}
    ends: dict[int, float] = {}            # gather index -> when it is done
    s = _Streams(trace=trace)
    buckets = _buckets([e for e in events if e.how == "gradient"], bucket_bytes)
    for e in buckets:
        by_op.setdefault(e.op, []).append(replace(e, how="bucket"))
    host = 0.0                             # when the host has issued op i
    for i, seconds in enumerate(compute_s):
        if i and phases[i] != "forward" and phases[i - 1] == "forward":
            s.note("backward")
        if device.host_s:                  # nothing of op i starts before the host issued it
            host += device.host_s[i]
            s.t = max(s.t, host)
        here = by_op.get(i, ())
        mine = [position[id(e)] for e in here if e.how == "gather"]
        for j in mine:                     # issued before the reader unless prefetched
            if j not in ends:
                ends[j] = s.issue(gathers[j], gathers[j].seconds)
        for j in mine:
            s.t = max(s.t, ends[j])
            s.note(f"wait {gathers[j].kind}")
        if mine:
            nxt = max(mine) + 1            # prefetch: issued right after this wait
            if nxt < len(gathers) and nxt not in ends and gathers[nxt].phase == phases[i]:
                ends[nxt] = s.issue(gathers[nxt], gathers[nxt].seconds)
        for e in here:
            if e.how == "serial":
                s.t = s.issue(e, e.seconds)
                s.note(f"wait {e.kind}")
        s.run(seconds, device.contention)
        name = names[i] if names is not None else None
        if name is not None:
            s.note(name)
        for e in here:
            if e.how == "bucket":           # issued once its last gradient exists
                s.issue(e, e.seconds)
    for e in buckets:                      # backward's end waits for every bucket
        s.note(f"wait {e.kind}")
    return max([s.t] + list(s.comm.values()))
