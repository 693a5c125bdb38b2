"""The pipeline-boundary marker (``torchalpa.mark_pipeline_boundary``): the identity.

Every dim of the result is the same factor as the operand's, so any sharding passes
through unchanged, and a Partial sum stays a Partial sum (the op is linear).
"""

from __future__ import annotations

from torchalpa.passes.rules.registry import FactorNamer, register

PIPELINE_BOUNDARY_OP = "torchalpa.pipeline_boundary.default"   # torchalpa.ops.markers


@register(PIPELINE_BOUNDARY_OP)
def pipeline_boundary(node, specs):
    f = FactorNamer()
    dims = f.dims(specs[0].shape)
    return f.rule([dims], [dims], linear=(frozenset({0}),))
