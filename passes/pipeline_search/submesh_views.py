"""The logical views a submesh is planned as, and which of them the pipeline search plans on.

Alpa enumerates, per submesh of the cluster, its 1D view and every 2D (data, tensor) grid
whose inner axis stays within a node. The search leaves out views on which some mesh axis
can shard nothing (``shardable_views``) and, when dims may be split over both axes of a
2D view, the 1D views of multi-node submeshes (``searched_views``); ``view_notes`` says so
in the plan.
"""

from __future__ import annotations

from dataclasses import replace

from torchalpa.core.cluster import Cluster
from torchalpa.core.opgraph import OpGraph

__all__ = ["logical_views", "tensor_dims", "shardable_views", "searched_views", "view_notes",
           "submesh_cluster"]


def logical_views(submesh: tuple[int, int]) -> list[tuple[int, ...]]:
    """Logical shapes a submesh is planned as (Alpa enumerates them per submesh): 1D, and
    every 2D ``(devices / inner, inner)`` whose inner axis stays within a node (``inner``
    divides the node's devices), so (1, 8) is tried as (8,), (4, 2), (2, 4) and (2, 8) as
    (16,), (8, 2), (4, 4), (2, 8): every (dp, tp) grid with tp within a node is a view."""
    n, m = submesh
    devices = n * m
    views: list[tuple[int, ...]] = [(devices,)]
    for inner in range(2, m + 1):
        if m % inner == 0 and devices // inner > 1:
            views.append((devices // inner, inner))
    return views


def tensor_dims(graph: OpGraph) -> frozenset[int]:
    """Every dim size of every value in the graph."""
    return frozenset(d for node in graph for spec in node.outputs for d in spec.shape)


def shardable_views(submesh: tuple[int, int], dims: frozenset[int]) -> list[tuple[int, ...]]:
    """The submesh's ``logical_views`` on which every mesh axis can shard some dim.

    Shardings split a dim evenly or not at all (``passes/sharding/strategies.py`` drops uneven
    splits; there is no padding), so an axis whose size divides no dim of any value in the
    graph (49 devices for a batch of 8, hidden 5120, ...) keeps everything replicated along
    it: every device on the axis repeats the same work, and the view costs what the view
    without that axis costs while holding more devices. Such views are skipped without a
    solve; on a 50-node cluster they are most of the node counts the DP would otherwise
    plan every distinct layer on (issue 15, item 4)."""
    return [view for view in logical_views(submesh)
            if all(size == 1 or any(d % size == 0 for d in dims) for size in view)]


def searched_views(submesh: tuple[int, int], dims: frozenset[int],
                   allow_mixed_mesh_shape: bool = True) -> list[tuple[int, ...]]:
    """The ``shardable_views`` of ``submesh`` the pipeline search plans layers on: all but
    the 1D view of a submesh of several nodes, when dims may be split over both axes of a
    2D view (``allow_mixed_mesh_shape``).

    That 1D view prices every collective on the link between nodes, over all its devices;
    the (nodes, devices per node) view offers each of its splits as a split over both
    axes (legal where the 1D one is: the same device count divides the dim) and prices
    it as a collective between nodes over ``nodes`` devices plus one within each node,
    which is cheaper unless the bytes are so few that the second latency outweighs the
    saving. On LLaMA-2-13B on 50 x 4 the 1D views' layers were 2-8x slower than on a 2D
    view of the same submesh (measured), and they were a third of the solves."""
    views = shardable_views(submesh, dims)
    if allow_mixed_mesh_shape and submesh[0] > 1 and submesh[1] > 1:
        views = [v for v in views if len(v) > 1]
    return views


def view_notes(submeshes: list[tuple[int, int]], dims: frozenset[int],
               allow_mixed_mesh_shape: bool = True) -> list[str]:
    """Plan notes naming the logical views the pipeline search skipped, and why."""
    unshardable, flat, unused = [], [], []
    for submesh in submeshes:
        shardable = shardable_views(submesh, dims)
        searched = searched_views(submesh, dims, allow_mixed_mesh_shape)
        unshardable += [v for v in logical_views(submesh) if v not in shardable]
        flat += [v for v in shardable if v not in searched]
        if not shardable:
            unused.append(submesh)
    notes = []
    if unshardable:
        left_out = f", so no stage is placed on submesh {_views_text(unused)}" if unused else ""
        notes.append(
            f"pipeline search: {len(unshardable)} logical views skipped because a mesh axis "
            f"divides no dim of any value in the step ({_views_text(unshardable)}){left_out}:"
            " a split must divide a dim evenly (no padding), so such an axis could only "
            "replicate, every device on it repeating the same work; give such a submesh by "
            "hand (ManualStageOption) to use it anyway")
    if flat:
        notes.append(
            f"pipeline search: {len(flat)} 1D views of multi-node submeshes skipped "
            f"({_views_text(flat)}): the (nodes, devices per node) view of the same submesh "
            "offers each of their splits over both axes, priced more cheaply")
    return notes


def _views_text(views: list[tuple[int, ...]], most: int = 6) -> str:
    shown = ", ".join(str(v) for v in views[:most])
    return shown + (f", ... {len(views) - most} more" if len(views) > most else "")


def submesh_cluster(cluster: Cluster, submesh: tuple[int, int]) -> Cluster:
    """``cluster`` cut down to ``submesh`` (nodes, devices per node), links unchanged."""
    return replace(cluster, num_nodes=submesh[0], devices_per_node=submesh[1])
