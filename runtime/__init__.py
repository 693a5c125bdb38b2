"""Runtime: execute a Plan on torch.distributed (NCCL on CUDA, gloo on CPU)."""
