"""Alpa's inter-op dynamic program: layers -> pipeline stages -> submeshes.

Given L layers, a cluster of N nodes x M devices and B micro-batches, choose contiguous
layer ranges (stages) and a submesh for each, tiling the cluster exactly, to minimize the
pipeline's latency ``sum(stage latencies) + (B - 1) * max(stage latency)``.

For a fixed bound ``t_max`` on any stage's latency, ``F[s, k, d]`` is the least total
latency of layers ``k..L-1`` cut into ``s`` stages on ``d`` devices:

    F[0, L, 0] = 0
    F[s, k, d] = min over i >= k, submesh j with size_j <= d:
                 cost(k..i, j) + F[s-1, i+1, d - size_j]   (cost(k..i, j) <= t_max,
                 and the stage fits in memory with s-1 stages after it in flight)

and the answer is ``min over t_max of min_s F[s, 0, N*M] + (B - 1) * t_max``. The t_max
are the distinct stage latencies, tried in increasing order; once ``(B - 1) * t_max``
alone exceeds the best pipeline found, larger ones cannot win and the search stops.

Submesh shapes are Alpa's: (1, 1), (1, 2), (1, 4), ..., (1, M), then (2, M), ..., (N, M);
any multiset of them that sums to N*M devices can be placed on the cluster.
``cost(k, i, j, s)`` is supplied by the caller (the intra-op planner's estimate, or a
profile) and is infinite when the stage cannot run there.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["submesh_shapes", "StageChoice", "PipelineSolution", "stage_dp", "brute_force"]


def submesh_shapes(num_nodes: int, devices_per_node: int) -> list[tuple[int, int]]:
    """Alpa's submesh shapes: powers of two within a node, then whole nodes."""
    shapes = []
    m = 1
    while m < devices_per_node:
        shapes.append((1, m))
        m *= 2
    shapes.append((1, devices_per_node))
    shapes += [(n, devices_per_node) for n in range(2, num_nodes + 1)]
    return shapes


@dataclass(frozen=True)
class StageChoice:
    layers: tuple[int, int]          # first and last layer (inclusive)
    submesh: tuple[int, int]
    latency: float


@dataclass(frozen=True)
class PipelineSolution:
    stages: tuple[StageChoice, ...]
    total: float                     # sum(latencies) + (B - 1) * max(latency)
    t_max: float
    num_t_max_tried: int = 0

    @property
    def forward_stage_layer_ids(self) -> list[list[int]]:
        return [list(range(s.layers[0], s.layers[1] + 1)) for s in self.stages]


CostFn = Callable[[int, int, int, int], float]
"""cost(first_layer, last_layer, submesh_index, num_stages_after) -> latency (inf: can't)."""


def _cost_table(num_layers: int, num_submeshes: int, max_stages: int, cost: CostFn) -> np.ndarray:
    """C[k, i, j, s]: latency of layers k..i on submesh j with s stages after it."""
    C = np.full((num_layers, num_layers, num_submeshes, max_stages), np.inf)
    for k in range(num_layers):
        for i in range(k, num_layers):
            for j in range(num_submeshes):
                for s in range(max_stages):
                    C[k, i, j, s] = cost(k, i, j, s)
    return C


def stage_dp(num_layers: int, num_nodes: int, devices_per_node: int, num_micro_batches: int,
             cost: CostFn, *, max_stages: int | None = None, epsilon: float = 1e-9
             ) -> PipelineSolution:
    """The best pipeline (Alpa's DP). Raises ValueError if no stage plan fits anywhere."""
    shapes = submesh_shapes(num_nodes, devices_per_node)
    sizes = np.array([n * m for n, m in shapes])
    D = num_nodes * devices_per_node
    L, J = num_layers, len(shapes)
    S = min(max_stages or L, L, D)
    C = _cost_table(L, J, S, cost)
    candidates = np.unique(C[np.isfinite(C)])
    if candidates.size == 0:
        raise ValueError("no layer range fits on any submesh (every stage cost is infinite)")
    B = num_micro_batches
    best: PipelineSolution | None = None
    tried = 0
    last = -math.inf
    for t_max in candidates:
        if best is not None and (B - 1) * t_max >= best.total:
            break
        if t_max - last <= epsilon * max(1.0, abs(t_max)):
            continue
        last = t_max
        tried += 1
        found = _dp_for_bound(C, sizes, D, S, t_max)
        if found is None:
            continue
        total, stages = found
        total += (B - 1) * max(st[3] for st in stages)
        if best is None or total < best.total:
            best = PipelineSolution(
                stages=tuple(StageChoice((k, i), shapes[j], lat) for k, i, j, lat in stages),
                total=float(total), t_max=float(max(st[3] for st in stages)))
    if best is None:
        raise ValueError("no pipeline fits: every assignment of layers to submeshes exceeds "
                         "memory or cannot run")
    return PipelineSolution(best.stages, best.total, best.t_max, tried)


def _dp_for_bound(C: np.ndarray, sizes: np.ndarray, D: int, S: int, t_max: float):
    """Min total latency under the bound, with the stages that reach it (or None)."""
    L, _, J, _ = C.shape
    F = np.full((S + 1, L + 1, D + 1), np.inf)
    choice = np.full((S + 1, L + 1, D + 1, 2), -1, dtype=np.int64)   # (i, j)
    F[0, L, 0] = 0.0
    allowed = np.where(C <= t_max, C, np.inf)
    for s in range(1, S + 1):
        for k in range(L - 1, -1, -1):
            row = F[s, k]
            for i in range(k, L):
                rest = F[s - 1, i + 1]
                if not np.isfinite(rest).any():
                    continue
                for j in range(J):
                    c = allowed[k, i, j, s - 1]
                    if not math.isfinite(c):
                        continue
                    sz = sizes[j]
                    cand = c + rest[: D + 1 - sz]
                    better = cand < row[sz:]
                    if better.any():
                        row[sz:] = np.where(better, cand, row[sz:])
                        idx = np.flatnonzero(better) + sz
                        choice[s, k, idx, 0] = i
                        choice[s, k, idx, 1] = j
    totals = F[1:, 0, D]
    if not np.isfinite(totals).any():
        return None
    s = int(np.argmin(totals)) + 1
    stages, k, d = [], 0, D
    while s > 0:
        i, j = choice[s, k, d]
        stages.append((k, int(i), int(j), float(allowed[k, i, j, s - 1])))
        k, d, s = int(i) + 1, d - int(sizes[j]), s - 1
    return float(F[len(stages), 0, D]), stages


def brute_force(num_layers: int, num_nodes: int, devices_per_node: int, num_micro_batches: int,
                cost: CostFn) -> float:
    """Every split of the layers and every submesh per stage (small cases only)."""
    shapes = submesh_shapes(num_nodes, devices_per_node)
    D = num_nodes * devices_per_node
    best = math.inf
    for cuts in itertools.chain.from_iterable(
            itertools.combinations(range(1, num_layers), r) for r in range(num_layers)):
        bounds = [0, *cuts, num_layers]
        ranges = [(bounds[a], bounds[a + 1] - 1) for a in range(len(bounds) - 1)]
        for js in itertools.product(range(len(shapes)), repeat=len(ranges)):
            if sum(shapes[j][0] * shapes[j][1] for j in js) != D:
                continue
            lats = [cost(k, i, j, len(ranges) - 1 - n) for n, ((k, i), j) in enumerate(zip(ranges, js))]
            if all(math.isfinite(t) for t in lats):
                best = min(best, sum(lats) + (num_micro_batches - 1) * max(lats))
    return best
