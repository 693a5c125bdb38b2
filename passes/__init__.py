"""Passes: pure functions from an OpGraph (+ mesh, costs, options) to planning data.

Nothing here imports torch execution code; a pass never mutates its input.

Layers, data flow, and where to add things: docs/architecture.md.
"""
