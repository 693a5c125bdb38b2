"""Runtime: execute a Plan on torch.distributed (NCCL on CUDA, gloo on CPU).

- ``lowering``: a Plan over the source graph -> this rank's local programs.
- ``rewrites``: the passes over lowered programs (buckets, overlap, memory), in one order.
- ``execution``: the programs run step after step on this job's ranks, as a module.
- ``measurement``: what a step really did and cost, beside what the plan said.
- ``resilience``: a failure on one rank reaches every rank as an error naming it.
- ``state``: checkpoints, pretrained weights loaded into shards, trained models saved.
- ``serving``: outputs without training, and generation with a static KV cache.

Layers, data flow, and where to add things: docs/architecture.md.
"""
