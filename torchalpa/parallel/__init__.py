"""From a model to a plan or a parallel module: the public entry points and the one
orchestration every method goes through (capture, plan on rank 0, lower, distribute).

Layers, data flow, and where to add things: docs/architecture.md.
"""
