"""Execution: a Plan run on this job's ranks, step after step.

- ``mesh``: the process group and DeviceMesh from the launch environment (torchrun or one
  process), the collective timeout, ``shutdown``.
- ``materialize``: parameters and buffers swapped in place for DTensors with the planned
  placements, from real weights (rank 0's) or meta ones (each rank its blocks).
- ``module``: ``ParallelModule``, the user's model with DTensor parameters whose calls,
  ``train_step``, ``predict``, ``unwrap`` and ``profile`` run the local programs.
- ``step``: ``StepRunner``, one rank's programs for a step, micro-batch by micro-batch
  through the schedule.
- ``pipeline``: a PipelinePlan's stages on their submeshes, activations and gradients
  sent between them.
- ``stage_replay``: a whole pipeline stage's forward run again before its backward
  (activation checkpointing at run time).
- ``collectives``: the collectives a local program calls, one small function per kind.
- ``pending_loss``: the loss ``pmodel(x, y)`` returns while its all-reduce is in flight.
- ``optim``: a lean optimizer step over DTensor parameters, on the local shards.
- ``host_optimizer``: optimizer states (and parameters) in host memory (ZeRO-Offload).
- ``precision``: mixed precision, float32 master parameters and a low-precision step.
"""
