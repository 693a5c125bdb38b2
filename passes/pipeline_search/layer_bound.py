"""What a searched pipeline costs at least, by its layers' own plans: read before any stage ILP.

The automatic search (``torchalpa.parallel.auto``) solves pipeline candidates one after
another; each costs a phase of layer ILPs (``layer_costs.py``) and then a far longer one
of stage DP rounds and exact stage ILPs (``stage_search.py``). Once a plan is in hand, a
candidate that cannot beat it should stop after its layer ILPs. This module bounds the
pipeline from those ILPs' plans, as ``shape_bound.py`` bounds it from the ops' rooflines:

- **A stage's micro-batch.** A range of layers on a submesh costs at least the sum of
  its layers' cheapest estimates there (the least over the submesh's searched views and
  over the fastest and the lean plan; ``LayerCosts.layer_estimate``), and at least its
  layers' compute floors (``shape_bound.layer_floors``). The first is what the stage DP
  itself adds up (``stage_costs.py``, less the sends between stages); the second is a
  proof by the cost model.
- **The schedule.** As in ``shape_bound.py``: a stage's ``B`` micro-batches one at a time,
  after the fill and before the drain of the stages before it. The seconds per micro-batch
  are taken without the share of what a stage runs once per step (``Estimate.once_share``:
  it follows a stage's last backward, which the stages before it need not wait for).
- **Memory.** A stage holds its layers' model states split over its devices at best.

The first point is the search's own premise, not a theorem: each layer's estimate is its
own intra-op ILP's plan (simplified: blocks sharing decisions, followers merged), and a
stage's ILP may find a plan cheaper than the sum of its layers' where it saves across
their boundary or unmerges a follower (``stage_search.UNIFORM_MARGIN``: GPT-15B's two-layer
stages). ``SLACK`` takes that share off the sums before they are compared; the tests hold
the bound below the estimate found on the small pipelines they plan. With
``stage_option="profile"`` (layer times measured) no bound is made.
"""

from __future__ import annotations

import math
import numpy as np

from torchalpa.core.cluster import Submesh
from torchalpa.passes.pipeline_search.layer_costs import LayerCosts
from torchalpa.passes.pipeline_search.shape_bound import (
    LayerFloors,
    layer_floors,
    pipeline_floor_s,
)
from torchalpa.passes.pipeline_search.stages import submesh_shapes

__all__ = ["SLACK", "CannotBeat", "layer_sums", "layers_floor_s", "search_floor_s"]

SLACK = 0.05
"""The share of a stage's layer sums a stage ILP is allowed to save across its layers
before the bound no longer holds: the sums are scaled by ``1 - SLACK``. The exact stage
prices of target b's first candidate were 0-13 % above their sums (none below); the
uniform partitions the search prices (``stage_search.UNIFORM_MARGIN``, 2 %) are the
cases the search itself expects to come in below their sums."""


class CannotBeat(Exception):
    """A pipeline search stopped after its layer ILPs: no plan of it beats ``above``
    seconds per step, because every one costs at least ``bound_s``."""

    def __init__(self, bound_s: float, above: float):
        super().__init__(f"cannot beat {above:.4g} s/step: its layers' own plans bound it at "
                         f"{bound_s:.4g} s/step")
        self.bound_s, self.above = bound_s, above


def layer_sums(layers: LayerCosts, shapes: list[Submesh], sizes: tuple[int, ...]
               ) -> np.ndarray:
    """(layers, len(sizes)): each layer's cheapest seconds per micro-batch on each
    submesh size (the least over the submesh's searched views, fastest and lean, without
    its once-per-step share); 0 where it has none there (no plan of it alone: the floors
    decide, as where it was not solved)."""
    by_size = {n * m: (n, m) for n, m in shapes}
    L = layers.problem.num_layers
    out = np.zeros((L, len(sizes)))
    for j, size in enumerate(sizes):
        submesh = by_size.get(size)
        if submesh is None:
            continue
        for l in range(L):
            found = [e for view in layers.views(submesh) for lean in (False, True)
                     if (e := layers.solved_estimate(l, view, submesh, lean)) is not None]
            if found:
                out[l, j] = min(e.seconds - e.once_share for e in found)
    return out


def layers_floor_s(floors: LayerFloors, sums: np.ndarray, num_devices: int,
                   num_micro_batches: int, budget: float = math.inf,
                   slack: float = SLACK) -> float:
    """Seconds a pipeline of ``num_micro_batches`` over ``num_devices`` devices takes at
    least by its layers' own plans (``sums``, ``layer_sums``, scaled by ``1 - slack``) and
    their compute floors (``floors``), whatever its stages (module doc)."""
    device = np.maximum(floors.device_s, (1.0 - slack) * sums)
    return pipeline_floor_s(LayerFloors(floors.sizes, device, floors.host_s, floors.state_bytes),
                            num_devices, num_micro_batches, budget)


def search_floor_s(layers: LayerCosts, slack: float = SLACK) -> float:
    """``layers_floor_s`` of the pipeline ``layers.problem`` searches, from the layer
    plans solved so far (after ``LayerCosts.prefetch``: every searched view's)."""
    problem = layers.problem
    cluster, method = problem.cluster, problem.method
    floors = layer_floors(problem.graph, problem.layer, cluster,
                          optimizer_states=method.optimizer_states,
                          eager=method.auto_sharding_option.elementwise != "fused")
    shapes = submesh_shapes(cluster.num_nodes, cluster.devices_per_node)
    return layers_floor_s(floors, layer_sums(layers, shapes, floors.sizes),
                          cluster.num_devices, method.num_micro_batches, problem.budget() or math.inf,
                          slack)
