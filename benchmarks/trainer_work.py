"""What a published run's trainer computed each micro-batch beside forward, backward and
the optimizer step, as ops priced by the cost model that prices the step.

A row names that work in ``PublishedRow.trainer_metrics``: the training metrics its
trainer updated on every micro-batch. ``trainer_seconds`` captures them as a forward-only
graph (``capture_forward``, the frontend the step goes through) on the logits one
micro-batch of every data-parallel replica makes, and sums ``compute_cost`` of each op
with the batch split over the replicas, times the micro-batches of a step.

Composer, the trainer of llm-foundry's MPT benchmarks, does this (mosaicml/composer at
v0.16.3, c82da77f, and likewise v0.13.3 and v0.16.4, the versions the tables' runs
pinned): ``Trainer._train_microbatch`` (composer/trainer/trainer.py lines 2472-2475) calls
``_eval_train_metrics(device_batch)`` after each micro-batch's backward whenever the model
has training metrics; that (lines 2162-2175) runs under ``torch.no_grad()`` and the
precision context (bf16 autocast) ``eval_forward(batch, outputs)``, which hands back the
logits forward kept (no second forward), then ``update_metric`` per metric.
``LanguageCrossEntropy.update`` (composer/metrics/nlp.py lines 104-127) is
``torch.nn.CrossEntropyLoss(ignore_index=-100, reduction='sum')`` over ``logits.view(N,
V)`` and ``(target != -100).sum()``; ``LanguagePerplexity`` subclasses it and differs only
in ``compute`` (once per logging step, not per micro-batch). PyTorch's autocast runs
``cross_entropy`` in float32 (its AMP op reference, "CUDA Ops that can autocast to
float32"): the bf16 logits are cast to float32 and their log-softmax taken over the
vocabulary in float32, eagerly (no compiler sees the metric), every micro-batch, once per
metric. The labels' shift and the batch's copy Composer also makes per micro-batch are
a few MB of int64 and are left out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from torchalpa.frontends.torch_export import capture_forward
from torchalpa.passes.pricing.cost import compute_cost

__all__ = ["TRAINER_METRICS", "check_trainer_metrics", "trainer_seconds",
           "metric_seconds_per_micro_batch"]

IGNORE_INDEX = -100
COMPUTE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def language_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Composer's ``LanguageCrossEntropy.update`` as autocast runs it: the summed
    cross-entropy of the logits cast to float32, and the count of targets not ignored."""
    target = targets.reshape(-1)
    losses = F.cross_entropy(logits.reshape(target.shape[0], -1).float(), target,
                             ignore_index=IGNORE_INDEX, reduction="sum")
    return losses + (target != IGNORE_INDEX).sum()


TRAINER_METRICS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "LanguageCrossEntropy": language_cross_entropy,
    "LanguagePerplexity": language_cross_entropy,   # a subclass: the same update
}
"""A training metric's name (Composer's class) -> its per-micro-batch update on
``(logits, targets)``."""


def check_trainer_metrics(names: tuple[str, ...]) -> None:
    """``ValueError`` naming the accepted metrics unless every one of ``names`` is known."""
    unknown = [n for n in names if n not in TRAINER_METRICS]
    if unknown:
        raise ValueError(f"trainer metric(s) {', '.join(map(repr, unknown))} unknown; "
                         f"accepted: {', '.join(TRAINER_METRICS)}")


class _Logits(torch.nn.Module):
    """The metric's input as a module: the logits forward returned."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def metric_seconds_per_micro_batch(name: str, mesh, logits_shape: tuple[int, ...],
                                   dtype: torch.dtype, replicas: int) -> float:
    """Seconds one device spends on metric ``name``'s update for one micro-batch: its ops
    captured on the global ``logits_shape`` (batch, sequence, vocabulary) in ``dtype``,
    each priced by ``compute_cost`` on ``mesh`` with the batch split ``replicas`` ways."""
    check_trainer_metrics((name,))
    with torch.device("meta"):
        logits = torch.empty(logits_shape, dtype=dtype)
        targets = torch.empty(logits_shape[:-1], dtype=torch.long)
    graph = capture_forward(_Logits(), (logits, targets), TRAINER_METRICS[name],
                            outputs=False).graph
    return sum(compute_cost(mesh, node, replicas) for node in graph.ops())


def trainer_seconds(row) -> float:
    """Seconds a step of ``row`` (a ``PublishedRow``) spends on its trainer's metrics: each
    metric's update once per micro-batch, on the logits of a micro-batch of every
    replica (the batch split over ``dp``; rows with tensor or pipeline parallelism are
    refused by the row itself). Zero for a row with no trainer metrics."""
    if not row.trainer_metrics:
        return 0.0
    mesh = row.cluster().logical_mesh((row.dp,))
    shape = (row.micro_batch * row.dp, row.seq, row.config["vocab_size"])
    dtype = COMPUTE_DTYPES[row.precision] if not row.float32_logits else torch.float32
    micro_batches = row.global_batch // (row.micro_batch * row.dp)
    return micro_batches * sum(metric_seconds_per_micro_batch(name, mesh, shape, dtype, row.dp)
                               for name in row.trainer_metrics)
