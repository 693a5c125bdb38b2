"""Frontends: turn a training step written in a framework into an OpGraph.

Layers, data flow, and where to add things: docs/architecture.md.
"""
