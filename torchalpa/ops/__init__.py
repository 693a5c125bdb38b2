"""torchalpa's custom torch ops (attention, batched matmul) and the pipeline-boundary marker.
Imports only ``torchalpa.core``.

Layers, data flow, and where to add things: docs/architecture.md.
"""
