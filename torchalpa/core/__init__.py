"""The IR and the records every layer shares: the op graph, placements, plans, clusters,
option records, schedules, progress. Imports nothing else of torchalpa's.

Layers, data flow, and where to add things: docs/architecture.md.
"""
