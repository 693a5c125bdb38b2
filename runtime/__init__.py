"""Runtime: execute a Plan on torch.distributed (NCCL on CUDA, gloo on CPU).

Layers, data flow, and where to add things: docs/architecture.md.
"""
