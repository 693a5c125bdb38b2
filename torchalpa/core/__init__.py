"""The IR and the records every layer shares: the op graph, placements, plans, clusters,
option records, schedules, progress. Imports nothing else of torchalpa's.

- ``opgraph``: ``OpGraph``, the training step as a graph of tensor ops, the one IR.
- ``placement``: how one tensor is laid out along one mesh axis (Shard, Replicate, Partial).
- ``plan``: ``Plan`` / ``PipelinePlan``, everything the runtime executes, as versioned data.
- ``plan_records``: typed records of what a plan predicts (``Estimates``) and why.
- ``plan_check``: checks a plan passes before anything runs it.
- ``cluster``: clusters and logical meshes, the hardware planned for.
- ``gpu_specs``: datasheet figures of known GPUs and their nodes.
- ``collective_math``: what one collective costs and the bytes it puts on the wire.
- ``fusion``: a StableHLO step's memory traffic as XLA's fusion moves it.
- ``options``: the parallel methods and their options (frozen, validated).
- ``option_keywords``: a method's unknown keyword answered with the option record that
  holds it.
- ``schedules``: pipeline schedules as data (1F1B, GPipe).
- ``calls``: how a model is called (positional tensors or keywords).
- ``resize_ops``: the ATen resize ops and how many dims each resizes.
- ``inplace_forms``: the ATen ops whose functional form copies then writes, with their
  in-place forms (read by the memory model and the runtime alike).
- ``choice_notes``: how AutoParallel's choice is written in a plan's notes and read back.
- ``input_errors``: refusals of what the user gave that carry their figures, so the Python
  API and the command line each word the remedy in their own terms.
- ``view_registry``: where the layers above register how a plan is shown.
- ``optimizer_step``: how the runtime's optimizer steps its tensors (all at once or one by
  one) and the temporaries each way makes, read by the memory model too.
- ``switches``: the planner's A/B switches (its fast paths), one frozen record per layer.
- ``progress`` / ``units``: logging and progress lines, sizes as people read them.
- ``collector``: the cyclic garbage collector paused over a burst of short-lived
  allocations (an LP bound's build).

Layers, data flow, and where to add things: docs/architecture.md.
"""
