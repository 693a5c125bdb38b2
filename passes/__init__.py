"""Passes: pure functions from an OpGraph (+ mesh, costs, options) to planning data.

Nothing here imports torch execution code; a pass never mutates its input.

- ``rules``: one declarative factor rule per op kind, shared by both frontends.
- ``pricing``: what ops, collectives and memory cost, and the bounds no plan goes below.
- ``sharding``: the intra-op pass: strategies, the cost graph, the ILP, the Plan.
- ``pipeline_search``: the inter-op pass: layers, the stage DP over submeshes, the
  pipeline's plan.

Layers, data flow, and where to add things: docs/architecture.md.
"""
