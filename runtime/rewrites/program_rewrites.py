"""Every rewrite of a rank's lowered programs, in the order the lowering applies them.

Each rewrite is a pass with a module of its own, named for what it does. This module is the
one place that applies them, in three groups (a straight list each, read top to bottom):

1. ``rewrite_joint_graph``: on the local joint graph (forward and backward together, before
   ``runtime.lowering.lower`` splits it), so what one side saves for the other follows the rewrite:
   attention's backward from the statistics its forward saved, ReLU's backward as one
   kernel, a linear layer's bias added inside its GEMM, the custom batched matmul inlined;
2. ``rewrite_split_programs``: on the forward, backward and gradient-reduction programs:
   a write into a buffer nothing reads afterwards made in place (a scatter into its
   zeros), parameters gathered once per step, gradients reduced in buckets, every collective waited
   for where its result is first used, parameter gathers prefetched;
3. ``step_programs``: the forward/backward pair a one-stage step runs in each mode
   (``rank_programs.StepPrograms``, ``StepMode``): the loss's all-reduce left in flight,
   backward and the gradients' reduction as one program, ``train_step``'s loss inside a
   gradient bucket, and copies with less Python per op.

None of them changes which collectives run or their bytes (the plan's list is what runs:
``runtime.measurement.issued``), and every value stays the same, bit for bit, except where a pass says
otherwise (the loss summed inside a bucket may differ in its last bit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.fx as fx

from torchalpa.core.plan import Plan
from torchalpa.runtime.lowering.rank_programs import (
    EagerOrTraced,
    LossInBucketBackward,
    LossInBucketPrograms,
    ProgramPair,
    ReducingBackward,
    StageProgram,
    StepPrograms,
    already_reduced,
    summed_backward,
)
from torchalpa.runtime.rewrites.attention_statistics import save_attention_statistics
from torchalpa.runtime.rewrites.buckets import (
    LossInBucket,
    collective_position,
    fuse_gradient_buckets,
    gradient_buckets,
)
from torchalpa.runtime.rewrites.call_overhead import cut_call_overhead
from torchalpa.runtime.rewrites.deferred_loss import defer_loss_wait
from torchalpa.runtime.rewrites.inline_batched_matmul import inline_batched_matmul
from torchalpa.runtime.rewrites.kept_buckets import keep_bucket_buffers
from torchalpa.runtime.rewrites.linear_bias import fuse_linear_bias
from torchalpa.runtime.rewrites.loss_in_bucket import put_loss_in_gradient_bucket
from torchalpa.runtime.rewrites.overlap import overlap_collectives, prefetch_parameter_gathers
from torchalpa.runtime.rewrites.param_gather import gather_parameters_once
from torchalpa.runtime.rewrites.reduce_in_backward import backward_with_reduce
from torchalpa.runtime.rewrites.release_inputs import release_inputs
from torchalpa.runtime.rewrites.relu_backward import fold_relu_backward
from torchalpa.runtime.rewrites.write_in_place import write_in_place

__all__ = ["rewrite_joint_graph", "rewrite_split_programs", "step_programs"]


def rewrite_joint_graph(graph: fx.Graph, *, device: torch.device, keep: frozenset[fx.Node],
                        source_of: dict[fx.Node, fx.Node]) -> None:
    """Group 1, in place. ``keep``: nodes the lowering holds by reference (the programs'
    outputs), left as they are; ``source_of``: local node -> the source node it computes
    (``local_graph.LocalGraph.source_of``)."""
    save_attention_statistics(graph, device, keep=keep)     # CPU kernels: no second forward
    fold_relu_backward(graph, keep=keep)                    # threshold_backward
    fuse_linear_bias(graph, source_of, keep=keep)           # addmm
    inline_batched_matmul(graph, keep=keep)                 # the custom op's body


def rewrite_split_programs(forward: fx.GraphModule, backward: fx.GraphModule,
                           reduce_grads: fx.GraphModule, plan: Plan, *,
                           grad_names: Sequence[str], num_micro_batches: int, num_state: int,
                           bucketed: bool = True, overlap: bool = True
                           ) -> fx.GraphModule | None:
    """Group 2, in place; returns the program of parameter gathers run once per step (None:
    none). ``grad_names``: the parameters of ``reduce_grads``' inputs, in order;
    ``num_state``: forward's leading placeholders that are parameters and buffers;
    ``bucketed`` / ``overlap``: whether to bucket the gradients' collectives and to
    overlap communication (both on outside of tests)."""
    for program in (forward, backward):
        write_in_place(program)                             # scatter into zeros: one buffer
    param_gathers = gather_parameters_once(forward, plan, num_micro_batches,
                                           num_state=num_state, bucketed=bucketed)
    if bucketed:
        fuse_gradient_buckets(reduce_grads, gradient_buckets(plan), grad_names=grad_names,
                              group_sizes=plan.mesh_shape)
    if overlap:
        for program in (forward, backward, reduce_grads, param_gathers):
            if program is not None:
                overlap_collectives(program)
        for program in (forward, backward):
            prefetch_parameter_gathers(program)
    return param_gathers


def step_programs(stage: StageProgram, plan: Plan, *, num_micro_batches: int,
                  one_stage: bool) -> StepPrograms:
    """Group 3: what a ``StepRunner`` runs for ``stage`` (of ``plan``, the stage's own): one
    forward/backward pair per ``StepMode``. ``one_stage``: the step is the stage's alone
    (an intra-op plan, or a pipeline of one stage); a stage of a longer pipeline, and
    programs compiled by ``torch.compile``, run as lowered in every mode. Whether
    ``train_step`` sends the loss inside a gradient bucket is decided here, once: where the
    programs allow it and the plan lists it."""
    if _streams_parameters(plan):       # parameters from host memory, per op
        from torchalpa.runtime.rewrites.param_stream import stream_parameters
        return StepPrograms.as_lowered(stream_parameters(stage.compiled_from or stage))
    lowered = StepPrograms.as_lowered(stage)
    if not one_stage or stage.compiled_from is not None:
        return lowered
    # the loss's all-reduce left in flight; waited for when the loss is read
    deferred = defer_loss_wait(stage.forward) if stage.has_loss else None
    forward, finish_loss = deferred if deferred is not None else (stage.forward, None)
    # run eagerly: copies with less Python per op (torch.compile traces the others)
    loss_first = replace(lowered.loss_first, finish_loss=finish_loss, forward=EagerOrTraced(
        forward, cut_call_overhead(forward, stage.num_results)))
    if num_micro_batches != 1:      # gradients summed over micro-batches, reduced once
        loss_first = replace(loss_first, backward=summed_backward(
            stage.backward, len(stage.grad_present),
            lambda gm: release_inputs(cut_call_overhead(gm))))
        # into buckets kept between steps; each sum freed once packed
        reduce_grads = EagerOrTraced(stage.reduce_grads, release_inputs(keep_bucket_buffers(
            cut_call_overhead(stage.reduce_grads))))
        loss_first = replace(loss_first, reduce_grads=reduce_grads)
        return replace(lowered, loss_first=loss_first, loss_last=loss_first)
    # one micro-batch: each gradient collective issued during backward
    backward_reduce = backward_with_reduce(stage.backward, stage.reduce_grads)
    # run eagerly: each bucket packed into buffers kept between steps, as DDP's are, and
    # each saved value freed at its last use, as autograd frees it
    loss_first = replace(loss_first, reduce_grads=already_reduced, backward=ReducingBackward(
        EagerOrTraced(backward_reduce, _eager_backward(backward_reduce))))
    # train_step: the loss all-reduced inside a gradient bucket
    in_bucket = None if not stage.has_loss else \
        listed_in_plan(put_loss_in_gradient_bucket(stage.forward, backward_reduce), plan)
    loss_last = loss_first if in_bucket is None else ProgramPair(
        cut_call_overhead(in_bucket.forward, stage.num_results),
        LossInBucketBackward(_eager_backward(in_bucket.backward_reduce), in_bucket.finish),
        already_reduced, loss_in_bucket=in_bucket.listed)
    return replace(lowered, loss_first=loss_first, loss_last=loss_last)


def _eager_backward(program: fx.GraphModule) -> fx.GraphModule:
    """The copy of a backward-and-reduce program a step runs eagerly: less Python per op,
    buckets packed into kept buffers, its inputs taken as one list it empties."""
    return release_inputs(keep_bucket_buffers(cut_call_overhead(program)))


def _streams_parameters(plan: Plan) -> bool:
    method = plan.method or {}
    return bool(method.get("offload_parameters") or
                (method.get("auto_sharding_option") or {}).get("offload_parameters"))


def listed_in_plan(programs: LossInBucketPrograms | None, plan: Plan
                   ) -> LossInBucketPrograms | None:
    """``programs`` with where ``plan`` lists the loss's all-reduce and its bucket, or None
    (given up: the loss keeps its own collective) when the plan cannot name it or the
    loss's part is not one element of the bucket's size."""
    if programs is None:
        return None
    consumer, slot, index = programs.plan_step
    position = collective_position(plan, consumer, slot, index)
    buckets = gradient_buckets(plan)
    if position is None or programs.bucket >= len(buckets) \
            or plan.collectives[position].bytes != buckets[programs.bucket].itemsize:
        return None
    return replace(programs, listed=LossInBucket(position, programs.bucket))
