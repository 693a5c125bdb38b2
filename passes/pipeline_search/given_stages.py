"""Stages the method gives instead of searching: by hand, or split uniformly.

``ManualStageOption`` names each stage's layers, submesh, logical view and option;
``UniformStageOption`` cuts the layers into equal stages on equal submeshes and lets the
additive stage estimates (``passes/pipeline_search/stage_costs.py``) choose each stage's view and
variant. Either way the stages are planned exactly by the assembly.
"""

from __future__ import annotations

from dataclasses import replace

from torchalpa.core.cluster import Cluster
from torchalpa.core.options import ManualStageOption, UniformStageOption
from torchalpa.passes.pipeline_search.stage_costs import StageCosts

__all__ = ["manual_stages", "uniform_stages"]


def manual_stages(option: ManualStageOption, L: int, cluster: Cluster) -> list:
    """The stages ((first, last), submesh, view, option) ``option`` gives for ``L``
    layers; ``ValueError`` if they do not cover the layers or the cluster."""
    if option.forward_stage_layer_ids[-1][-1] != L - 1:
        raise ValueError(f"ManualStageOption covers layers 0..{option.forward_stage_layer_ids[-1][-1]}"
                         f" but the model has {L} layers (0..{L - 1})")
    used = sum(n * m for n, m in option.submesh_shapes)
    if used != cluster.num_devices:
        raise ValueError(f"ManualStageOption's submeshes use {used} devices, the cluster has "
                         f"{cluster.num_devices}")
    out = []
    for s, ids in enumerate(option.forward_stage_layer_ids):
        submesh = option.submesh_shapes[s]
        view = tuple(option.logical_shapes[s]) if option.logical_shapes else (submesh[0] * submesh[1],)
        opt = option.options[s] if option.options else None
        out.append(((ids[0], ids[-1]), submesh, view, opt))
    return out


def uniform_stages(option: UniformStageOption, L: int, cluster: Cluster, costs: StageCosts,
                   B: int, schedule: str) -> tuple[list, list[bool]]:
    """``option.num_stages`` stages (default: one per node, or two on one node) of about
    ``L / stages`` layers each on equal submeshes, each on the view and variant the
    additive estimates find fastest; and whether each is recomputed."""
    S = option.num_stages or (cluster.num_nodes if cluster.num_nodes > 1 else 2)
    if cluster.num_devices % S or L < S:
        raise ValueError(f"uniform stages: {S} stages need {S} <= {L} layers and a device "
                         f"count ({cluster.num_devices}) they divide")
    per = cluster.num_devices // S
    submesh = (per // cluster.devices_per_node, cluster.devices_per_node) \
        if per >= cluster.devices_per_node else (1, per)
    bounds = [round(s * L / S) for s in range(S + 1)]
    out, recompute = [], []
    for s in range(S):
        k, i = bounds[s], bounds[s + 1] - 1
        flight = min(B, S - s) if schedule == "1f1b" else B
        _, chosen = costs.cost(k, i, submesh, flight)
        view, lean, again = chosen if chosen is not None else ((per,), False, False)
        sharding = replace(costs.problem.method.auto_sharding_option, parameters="sharded") \
            if lean else None
        out.append(((k, i), submesh, view, sharding))
        recompute.append(again)
    return out, recompute
