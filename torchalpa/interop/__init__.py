"""torchalpa and other systems: StableHLO export and annotation, XLA/JAX shardings,
torch's tensor-parallel plans, JAX functions and StableHLO programs as inputs.

Layers, data flow, and where to add things: docs/architecture.md.
"""
