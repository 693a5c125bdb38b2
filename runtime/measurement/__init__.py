"""Measurement: what a step really did and cost, next to what the plan said.

- ``stats``: ``pm.last_step_stats()``, the last step measured beside the plan.
- ``issued``: the collectives a step issues as the runtime packs them (buckets, once-per-step
  reductions), what tests and benchmarks compare with what ran.
- ``comm_count``: the collectives a program issues, counted at the dispatcher.
- ``traffic``: the bytes this rank's collectives were handed, and their profiler names.
- ``timeline``: ``pm.profile(...)``, a measured Chrome/Perfetto trace of training steps.
- ``tensorboard``: ``torchalpa.TensorBoardHook``, step statistics as TensorBoard scalars.
- ``profile``: layers timed on this job's devices (``stage_option="profile"``).
- ``measure``: side-by-side measurements (step time, loopback bytes, peak memory).
- ``host_memory``: this process's resident set size and its high-water mark.
- ``allocated``: the bytes a function allocates at its peak, on any device (the profiler's
  allocation records summed in order), and what held them there.
- ``settle``: while ``allocated`` records, a collective's tensors freed on the caller's
  thread, where the profiler sees the free (gloo's worker thread is out of its sight).
- ``baselines``: DDP and FSDP2, the hand-written baselines benchmarks compare against.
"""
