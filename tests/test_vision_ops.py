"""Vision ops models use and we did not write rules for at first: group norm (diffusers-style
blocks, BiT, PoolFormer), upsampling (segmentation heads: bilinear to the input size, nearest
in feature pyramids) and sliding windows (``Tensor.unfold``).

A small segmentation network with each of them captures with a rule for every op, keeps
group norm's backward as one op, and its plan on 4 devices splits every one of them (by
batch, or by channels for group norm's whole groups), instead of running them replicated.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
from torchalpa.core.placement import Shard
from torchalpa.frontends.torch_export import capture

GROUP_NORM = "aten.native_group_norm.default"
GROUP_NORM_BACKWARD = "aten.native_group_norm_backward.default"
BILINEAR = "aten.upsample_bilinear2d.default"
BILINEAR_BACKWARD = "aten.upsample_bilinear2d_backward.default"
NEAREST_BACKWARD = "aten.upsample_nearest2d_backward.default"
UNFOLD = "aten.unfold.default"


class TinySegmenter(nn.Module):
    """conv -> group norm -> strided conv -> nearest x2 -> windows -> bilinear to the input."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(4, 8)
        self.down = nn.Conv2d(8, 8, 3, stride=4, padding=1)
        self.head = nn.Conv2d(8, classes, 1)

    def forward(self, x):                                    # (B, 3, H, W)
        h = F.relu(self.norm(self.stem(x)))                  # (B, 8, H, W)
        h = self.down(h)                                     # (B, 8, H/4, W/4)
        h = F.interpolate(h, scale_factor=2, mode="nearest")     # (B, 8, H/2, W/2)
        h = h + h.unfold(3, 2, 2).mean(-1).repeat_interleave(2, -1)  # windows along W
        logits = self.head(h)                                # (B, classes, H/2, W/2)
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)


def _on_activations(graph, op: str) -> list:
    """The nodes of ``op`` that read activations: unfold's backward also unfolds an arange
    of positions (a small index tensor, rightly replicated)."""
    return [n for n in graph.ops()
            if n.op == op and not (op == UNFOLD and n.phase == "backward")]


def _batch():
    return torch.randn(8, 3, 16, 16), torch.randint(3, (8, 16, 16))


def test_group_norm_backward_is_one_op_and_every_op_has_a_rule():
    from torchalpa.passes.rules import rule_for
    graph = capture(TinySegmenter(), _batch(), F.cross_entropy).graph
    ops = [n.op for n in graph.ops()]
    for op in (GROUP_NORM, GROUP_NORM_BACKWARD, BILINEAR, BILINEAR_BACKWARD, NEAREST_BACKWARD,
               UNFOLD):
        assert op in ops, op
    assert ops.count(GROUP_NORM_BACKWARD) == 1
    assert not [n.op for n in graph.ops() if rule_for(n, graph) is None]


def test_segmenter_plan_splits_norms_and_upsampling():
    plan = torchalpa.plan(TinySegmenter(), _batch(), F.cross_entropy,
                          cluster=torchalpa.Cluster.local_cpu(4),
                          method=torchalpa.ShardParallel(logical_mesh_shape=(4,)))
    assert plan.unsupported_ops == ()
    graph = capture(TinySegmenter(), _batch(), F.cross_entropy).graph
    chosen = {s.node: s for s in plan.strategies}
    for op in (GROUP_NORM, GROUP_NORM_BACKWARD, BILINEAR, BILINEAR_BACKWARD, NEAREST_BACKWARD,
               UNFOLD):
        for n in _on_activations(graph, op):
            assert isinstance(chosen[n.name].outputs[0][0], Shard), (op, chosen[n.name])
