"""Pricing: what ops, collectives and memory cost, as the planner counts them.

- ``cost``: Alpa's cost model, alpha-beta collectives per mesh axis and a compute roofline.
- ``kernel_model``: what a GPU kernel costs beyond flops and bytes (shape effects).
- ``fused_pricing``: elementwise chains priced as a fusing compiler runs them.
- ``inplace_pricing``: the writes into state the runtime does in place.
- ``buffer_reuse``: op results written into an operand's buffer, with no storage of their own.
- ``attention_price``: attention's backward, and what its forward keeps for it.
- ``overlap_price``: the step's time with communication overlapped as the runtime does.
- ``memory``: per-device memory of a plan (model states plus live activations).
- ``step_end``: what one device holds at the optimizer step, the end of a training step.
- ``sum_reduction``: what one device holds where a step reduces its micro-batches' sums.
- ``state_gather``: what one device holds where a step gathers its parameters before its
  first micro-batch.
- ``grad_buckets``: the runtime's gradient buckets, and where each is packed.
- ``gathered_views``: gathered copies a forward view keeps alive until backward reads it.
- ``offload_price``: what offloading optimizer states to host memory costs.
- ``bounds``: what any plan of a step must at least cost, found without a solver.
"""
