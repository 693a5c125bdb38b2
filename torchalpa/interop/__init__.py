"""torchalpa and other systems: StableHLO export and annotation, XLA/JAX shardings,
torch's tensor-parallel plans, JAX functions and StableHLO programs as inputs.

- ``programs``: a JAX function or a StableHLO program planned as a training step.
- ``stablehlo_export``: ``export_stablehlo``, a torch training step as StableHLO.
- ``stablehlo_locations``: each exported op's module path and source line.
- ``hlo_annotate``: a StableHLO step annotated with its plan, for XLA's partitioner.
- ``xla``: a plan run with XLA (``jax.jit`` shardings, the collectives XLA chose).
- ``tp_plan``: a plan as torch's tensor-parallel plan (``parallelize_module``).

Layers, data flow, and where to add things: docs/architecture.md.
"""
