"""The collectives one training step issues, as the runtime packs them: what the
plan lists, with gradient buckets, parameter-gather buckets and once-per-step
reductions applied. Tests and benchmarks compare it with what really ran."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torchalpa.core.plan import Collective, Plan
from torchalpa.runtime.rewrites.buckets import (
    GradientBucket,
    LossInBucket,
    gradient_buckets,
    is_gradient,
)
from torchalpa.runtime.rewrites.param_gather import gather_buckets, gathered_once

__all__ = ["issued_collectives"]


def issued_collectives(plan: Plan, num_micro_batches: int = 1,
                       buckets: Sequence[GradientBucket] | None = None, *,
                       loss_in_bucket: LossInBucket | None = None, one_stage: bool = True
                       ) -> list[Collective]:
    """Every collective one step issues: the final resharding of each gradient once (with
    each bucket's members as one collective), everything else once per micro-batch;
    ``loss_in_bucket``: the loss's all-reduce inside its bucket (one micro-batch only).
    ``one_stage``: the plan runs as a one-stage step (``runtime.lowering.lower.lower``), whose
    parameters' forward gathers run once per step, bucketed (``runtime.rewrites.param_gather``);
    False for a stage of a pipeline, which gathers per micro-batch."""
    buckets = gradient_buckets(plan) if buckets is None else buckets
    in_bucket = {i for b in buckets for i in b.positions}
    in_bucket |= {i for b in buckets for stage in b.then for i in stage.positions}
    hoisted = gathered_once(plan, num_micro_batches) if one_stage else {}
    gathers = gather_buckets(plan, num_micro_batches) if one_stage else ()
    in_bucket |= {i for b in gathers for i in b.positions}
    with_loss: dict[int, int] = {}       # bucket -> bytes of the loss it carries
    if loss_in_bucket is not None:
        assert num_micro_batches == 1, "a loss travels in a bucket in one-micro-batch steps only"
        in_bucket.add(loss_in_bucket.position)
        with_loss[loss_in_bucket.bucket] = plan.collectives[loss_in_bucket.position].bytes
    once = {i for positions in hoisted.values() for i in positions}
    position = -1
    for r in plan.reshards:
        for s in r.steps:
            if s.is_collective:
                position += 1
                if is_gradient(r.consumer, r.slot):
                    once.add(position)
    out: list[Collective] = []
    for i, c in enumerate(plan.collectives):
        if i not in in_bucket:
            out += [c] * (1 if i in once else num_micro_batches)
    for i, b in enumerate(buckets):
        first = plan.collectives[b.positions[0]]
        out.append(replace(first, bytes=b.bytes + with_loss.get(i, 0), source="",
                           tensor=f"bucket of {len(b.params)} gradients"
                           + (" and the loss" if i in with_loss else "")))
        for stage in b.then:
            out.append(replace(plan.collectives[stage.positions[0]], bytes=stage.bytes,
                               source="", tensor=f"bucket of {len(b.params)} gradients"))
    for g in gathers:
        out.append(replace(plan.collectives[g.positions[0]], bytes=g.bytes, source="",
                           tensor=f"bucket of {len(g.readers)} parameters"))
    return out
