"""torchalpa's custom torch ops (attention, batched matmul, fused cross-entropy) and the pipeline-boundary marker.
Imports only ``torchalpa.core``.

- ``attention``: ``torchalpa::sdpa``, scaled dot-product attention as one device-neutral op.
- ``cross_entropy``: ``torchalpa::cross_entropy``, a fused cross-entropy that keeps no
  float32 log-probabilities (chunked over tokens).
- ``batched_matmul``: ``torchalpa::batched_matmul``, a product over several batch dims.
- ``markers``: ``mark_pipeline_boundary``, where the user wants the pipeline cut.

Layers, data flow, and where to add things: docs/architecture.md.
"""
