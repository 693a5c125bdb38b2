"""Rewrites of lowered programs, each a pass of its own, applied in one place
(``program_rewrites``, in the order the lowering needs them).

- ``program_rewrites``: every rewrite of a rank's programs, in order.
- ``overlap``: communication moved to overlap computation.
- ``buckets``: gradient collectives merged into buckets (one all-reduce or reduce-scatter).
- ``reduce_in_backward``: backward and the gradients' collectives as one program, each
  issued once its gradients exist.
- ``loss_in_bucket``: a ``train_step``'s loss all-reduced inside a gradient bucket.
- ``deferred_loss``: the loss's all-reduce left in flight until the loss is read.
- ``param_gather``: parameters gathered once per step in buckets, not per micro-batch.
- ``param_stream``: parameters streamed from host memory per op, gradients back.
- ``attention_statistics``: attention's backward from what its forward saved.
- ``inline_batched_matmul``: ``torchalpa::batched_matmul`` run as its body.
- ``linear_bias``: ``add(mm(a, b), bias)`` run as ``addmm``.
- ``relu_backward``: ReLU's backward as ``threshold_backward``, as eager autograd runs it.
- ``write_in_place``: writes into a buffer nothing reads afterwards, made in place as eager
  makes them.
- ``call_overhead``: copies of the programs with less Python per op.
- ``release_inputs``: programs that take their inputs as one list and free each after its
  last read (the backward's saved values, as autograd frees them).
- ``grad_sums``: a micro-batch's gradients added into the step's sums inside backward.
- ``kept_buckets``: gradient buckets packed into flat buffers kept between steps, as DDP's.
"""
