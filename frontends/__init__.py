"""Frontends: turn a training step written in a framework into an OpGraph.

A torch model and its loss (``torch_export``, through torch.export's joint graph):

- ``torch_export``: the capture itself, model + loss, forward and backward -> OpGraph.
- ``functionalize``: the traced joint graph made purely functional (buffer writes as outputs).
- ``constants``: tensors a forward makes from Python values become ops.
- ``einsum_products``: ``torch.einsum`` matrix products traced as ``torchalpa::batched_matmul``.
- ``restride`` / ``piece_views``: strided views written as reshapes and splits.
- ``merged_batch``: a ``bmm`` over batch dims the model merged itself (``B * heads``)
  written as ``torchalpa::batched_matmul`` over them.
- ``joint_graph``: walking a captured joint graph (what a set of results depends on).
- ``block_remat`` / ``param_remat``: activation checkpointing per layer, and backward's own
  views of the parameters (ZeRO-3), as graph passes.
- ``opset``: which ATen ops a step is made of, and what each costs.
- ``repeated``: the step's repeated layers, so passes can share one decision per kind.
- ``rebatch``: the step at 1/k of the batch derived from its capture, not traced again.
- ``op_record``: the ops a step dispatches, recorded on meta tensors without tracing.
- ``rebatch_check``: two such records vouch that a derived micro-batch step is the traced one.
- ``meta_memo``: meta-kernel results remembered by argument layout, so the derivation's run
  and the records run each distinct op call once, not once per identical layer.
- ``provenance`` / ``naming``: where each op came from (module path, source line) and
  names a person recognizes for its values.

A step written in StableHLO (from JAX or torch-mlir) read in the ATen vocabulary:

- ``stablehlo``: the reader, StableHLO text -> OpGraph.
- ``hlo_readers``: one reader per StableHLO op name (``READERS``).
- ``hlo_dot`` / ``hlo_gather`` / ``hlo_slices`` / ``hlo_sums``: ``dot_general``,
  one-element gathers and scatters, equal slices, and sums of products, as ATen has them.
- ``jax_lower``: a JAX training step lowered to StableHLO, its parameters named.

Layers, data flow, and where to add things: docs/architecture.md.
"""
