"""What a searched pipeline costs at least, by its layers' own plans: read before any stage ILP.

The automatic search (``torchalpa.parallel.auto``) solves pipeline candidates one after
another; each costs a phase of layer ILPs (``layer_costs.py``) and then a far longer one
of stage DP rounds and exact stage ILPs (``stage_search.py``). Once a plan is in hand, a
candidate that cannot beat it should stop after its layer ILPs. This module bounds the
pipeline from those ILPs' plans, as ``shape_bound.py`` bounds it from the ops' rooflines.
The estimate it bounds is the assembly's (``pipeline_assembly.pipeline_estimates``): the
schedule simulated on each stage's forward and backward seconds per micro-batch
(``FORWARD_SHARE`` of its step time forward), each stage's forward sends as the latency of
both directions, and what each stage runs once per step after its last backward.

- **A stage's micro-batch.** A range of layers on a submesh costs at least the sum of
  its layers' cheapest estimates there (the least over the submesh's searched views and
  over the fastest and the lean plan; ``LayerCosts.solved_estimate``), and at least its
  layers' compute floors (``shape_bound.layer_floors``). A layer with no plan on a
  submesh, or a submesh with no searched view, is never part of a stage there: the search
  places none (``StageCosts.candidates``).
- **Fill and drain** (``layers_floor_s``). As in ``shape_bound.py``, every stage runs its
  ``B`` micro-batches one at a time after the stages before it filled and before they
  drain: ``B * t_s + sum(t_j, j < s)`` with ``t`` without the once-per-step share
  (``Estimate.once_share``: it follows a stage's last backward, which no stage before
  waits for); and with that share, ``B * t_s`` after the forwards before it only.
- **Round trips** (``round_trip_floor_s``, 1F1B only). The first of ``S`` stages starts
  micro-batch ``m + S`` after ``m``'s backward, which comes back through every stage and
  every cut both ways: at least ``ceil(B / S)`` round trips of ``sum_s t_s + 2 sum_cuts
  send`` (each cut's forward values at their cheapest on any searched view,
  ``StageCosts.forward_seconds``), against ``B`` times the slowest stage.
- **Memory.** A stage holds its layers' model states split over its devices at best.

The first point is the search's own premise, not a theorem: each layer's estimate is its
own intra-op ILP's plan (simplified: blocks sharing decisions, followers merged), and a
stage's ILP may find a plan cheaper than the sum of its layers' where it saves across
their boundary or unmerges a follower (``stage_search.UNIFORM_MARGIN``: GPT-15B's two-layer
stages). ``SLACK`` takes that share off the sums before they are compared; the tests hold
the bound below the estimate found on the small pipelines they plan, without the slack
too. With ``stage_option="profile"`` (layer times measured) no bound is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from torchalpa.core.cluster import Submesh
from torchalpa.passes.pipeline_search.layer_costs import LayerCosts
from torchalpa.passes.pipeline_search.shape_bound import (
    LayerFloors,
    layer_floors,
    pipeline_floor_s,
)
from torchalpa.passes.pipeline_search.stage_costs import StageCosts
from torchalpa.passes.pipeline_search.stage_recompute import FORWARD_SHARE
from torchalpa.passes.pipeline_search.stages import submesh_shapes

__all__ = ["SLACK", "CannotBeat", "LayerSums", "layer_sums", "layers_floor_s",
           "cut_seconds", "round_trip_floor_s", "search_floor_s"]

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


@dataclass(frozen=True)
class LayerSums:
    """Per layer and submesh size (``LayerFloors.sizes``), its least seconds per
    micro-batch by its own plans: ``step_s`` without its share of the once-per-step work,
    ``whole_s`` with it (each the least over the plans, so not a sum of the two)."""

    step_s: np.ndarray
    whole_s: np.ndarray


def layer_sums(layers: LayerCosts, shapes: list[Submesh], sizes: tuple[int, ...]
               ) -> LayerSums:
    """Each layer's cheapest seconds per micro-batch on each submesh size (the least over
    the submesh's searched views, fastest and lean). Where the submesh has no searched
    view, or the layer no plan on any (solved, none fits), inf: the search places no stage
    of it there (``StageCosts.candidates``); where a view was not solved, 0 (the floors
    decide)."""
    by_size = {n * m: (n, m) for n, m in shapes}
    L = layers.problem.num_layers
    step, whole = np.zeros((L, len(sizes))), np.zeros((L, len(sizes)))
    for j, size in enumerate(sizes):
        submesh = by_size.get(size)
        if submesh is None:
            continue
        views = layers.views(submesh)
        for l in range(L):
            solved = [layers.solved_estimate(l, view, submesh, lean)
                      for view in views for lean in (False, True)]
            if not all(known for known, _ in solved):
                continue
            found = [e for _, e in solved if e is not None]
            step[l, j] = min((e.seconds - e.once_share for e in found), default=math.inf)
            whole[l, j] = min((e.seconds for e in found), default=math.inf)
    return LayerSums(step, whole)


def layers_floor_s(floors: LayerFloors, sums: LayerSums, num_devices: int,
                   num_micro_batches: int, budget: float = math.inf,
                   slack: float = SLACK) -> float:
    """Seconds a pipeline of ``num_micro_batches`` over ``num_devices`` devices takes at
    least by its layers' own plans (``sums``, scaled by ``1 - slack``) and their compute
    floors (``floors``), whatever its stages (module doc)."""
    keep = 1.0 - slack
    step = np.maximum(floors.device_s, keep * sums.step_s)
    whole = np.maximum(floors.device_s, keep * sums.whole_s)
    drained = pipeline_floor_s(LayerFloors(floors.sizes, step, floors.host_s,
                                           floors.state_bytes),
                               num_devices, num_micro_batches, budget)
    once = pipeline_floor_s(LayerFloors(floors.sizes, whole, floors.host_s, floors.state_bytes),
                            num_devices, num_micro_batches, budget,
                            fill_s=FORWARD_SHARE * step)
    return max(drained, once)


def cut_seconds(costs: StageCosts) -> np.ndarray:
    """(layers - 1,): per cut, the least seconds forward's values crossing it take to send
    (``StageCosts.forward_seconds``, the least over the searched views of every submesh)."""
    problem = costs.problem
    shapes = submesh_shapes(problem.cluster.num_nodes, problem.cluster.devices_per_node)
    meshes = [problem.mesh(submesh, view) for submesh in shapes
              for view in costs.layers.views(submesh)]
    return np.array([min((costs.forward_seconds(cut, mesh) for mesh in meshes), default=0.0)
                     for cut in range(problem.num_layers - 1)])


def round_trip_floor_s(floors: LayerFloors, step_s: np.ndarray, cuts: np.ndarray,
                       num_devices: int, num_micro_batches: int,
                       budget: float = math.inf, rounds: int = 40) -> float:
    """Seconds a 1F1B pipeline takes at least, by its round trips and its slowest stage.
    A stage with ``n - 1`` stages after it starts micro-batch ``m + n`` only after
    micro-batch ``m``'s backward there, which waits for ``m`` to go forward through those
    stages and back, sent across each cut between them both ways; so the step is at least
    ``ceil(B / n)`` such round trips, ``R = sum of the n stages' t + 2 sum of their cuts'
    send`` (``cuts``: per cut, ``cut_seconds``), for every stage, and at least ``B t`` of
    every stage. The bound is the least ``M`` for which some cut of the layers into
    stages on all devices (``step_s``: per layer and size, inf where barred) keeps every
    one of those terms at most ``M``: bisection on ``M`` (``rounds`` halvings), each
    feasibility a dynamic program from the last layer keeping, per (first layer, stages,
    devices), the least ``R`` whose terms all stay within ``M`` (a larger ``R`` is never
    better for the stages before)."""
    L, B = step_s.shape[0], num_micro_batches
    top = np.zeros((1, len(floors.sizes)))
    barred = np.vstack([top, np.cumsum(~np.isfinite(step_s), axis=0)])
    total = np.vstack([top, np.cumsum(np.where(np.isfinite(step_s), step_s, 0.0), axis=0)])
    states = np.concatenate([[0.0], np.cumsum(floors.state_bytes)])
    stages = sorted(((k, i, size, float(total[i + 1, j] - total[k, j]))
                     for k in range(L) for i in range(k, L)
                     for j, size in enumerate(floors.sizes)
                     if size <= num_devices and (states[i + 1] - states[k]) / size <= budget
                     and barred[i + 1, j] == barred[k, j]), key=lambda st: -st[0])
    most = min(L, num_devices)
    trips = np.array([math.ceil(B / n) for n in range(1, most + 1)], dtype=float)[:, None]

    def fits(limit: float) -> bool:
        # least[n, k, d]: the least round trip R of layers k.. cut into n stages on d
        # devices whose every term stays within ``limit``
        least = np.full((most + 1, L + 1, num_devices + 1), math.inf)
        least[0, L, 0] = 0.0
        for k, i, size, t in stages:
            if B * t > limit:
                continue
            send = 2.0 * cuts[i] if i < L - 1 else 0.0
            trip = t + send + least[:-1, i + 1, :num_devices + 1 - size]
            trip[trips * trip > limit * (1 + 1e-12)] = math.inf
            least[1:, k, size:] = np.minimum(least[1:, k, size:], trip)
        return bool(np.isfinite(least[1:, 0, num_devices]).any())

    if not stages:
        return math.inf
    low, high = 0.0, B * sum(t for *_, t in stages)
    if not fits(high):
        return math.inf
    for _ in range(rounds):
        mid = (low + high) / 2
        if fits(mid):
            high = mid
        else:
            low = mid
    return low


def search_floor_s(costs: StageCosts, slack: float | None = None) -> float:
    """The pipeline ``costs.problem`` searches bounded by its layers' plans solved so far
    (after ``LayerCosts.prefetch``: every searched view's): ``layers_floor_s``, and for
    1F1B the larger ``round_trip_floor_s``; ``slack``: default ``SLACK``."""
    slack = SLACK if slack is None else slack
    problem, layers = costs.problem, costs.layers
    cluster, method = problem.cluster, problem.method
    floors = layer_floors(problem.graph, problem.layer, cluster,
                          optimizer_states=method.optimizer_states,
                          eager=method.auto_sharding_option.elementwise != "fused")
    shapes = submesh_shapes(cluster.num_nodes, cluster.devices_per_node)
    sums = layer_sums(layers, shapes, floors.sizes)
    budget = problem.budget() or math.inf
    bound = layers_floor_s(floors, sums, cluster.num_devices, method.num_micro_batches,
                           budget, slack)
    if method.pipeline_schedule != "1f1b":
        return bound
    step = np.maximum(floors.device_s, (1.0 - slack) * sums.step_s)
    return max(bound, round_trip_floor_s(floors, step, (1.0 - slack) * cut_seconds(costs),
                                         cluster.num_devices, method.num_micro_batches,
                                         budget))
