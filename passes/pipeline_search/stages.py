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
from collections.abc import Callable
from dataclasses import dataclass

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
    num_candidates: int = 0          # (i, j, d) entries the DP runs compared, all bounds

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
    values = np.unique(C[np.isfinite(C)])
    if values.size == 0:
        raise ValueError("no layer range fits on any submesh (every stage cost is infinite)")
    bounds, dropped_low = _spaced_bounds(values, epsilon)
    best = _BoundSearch(C, sizes, D, S, num_micro_batches, bounds, dropped_low).run()
    if best is None:
        raise ValueError("no pipeline fits: every assignment of layers to submeshes exceeds "
                         "memory or cannot run")
    total, stages, runs, compared = best
    return PipelineSolution(
        stages=tuple(StageChoice((k, i), shapes[j], lat) for k, i, j, lat in stages),
        total=float(total), t_max=float(max(st[3] for st in stages)), num_t_max_tried=runs,
        num_candidates=compared)


def _spaced_bounds(values: np.ndarray, epsilon: float) -> tuple[list[float], float]:
    """The stage-latency bounds the DP is run for: the distinct ``values`` ascending, each
    one more than ``epsilon`` (relative) above the last one kept; and the smallest value
    left out that way (inf if none)."""
    kept: list[float] = []
    dropped_low = math.inf
    last = -math.inf
    for t in values.tolist():
        if t - last <= epsilon * max(1.0, abs(t)):
            dropped_low = min(dropped_low, t)
            continue
        kept.append(t)
        last = t
    return kept, dropped_low


class _BoundSearch:
    """Alpa's scan over the bounds t_max, ascending, keeping the first pipeline with the
    least ``sum + (B - 1) * max``, with the DP run for far fewer bounds.

    The plain scan runs the DP for every bound until ``(B - 1) * t_max`` alone reaches the
    best total (GPT-39B, 16 layers on 8 x 8: thousands of bounds, a minute per search
    round). Here the bounds are visited as intervals, lowest first, and an interval
    [a, b] is passed over without running the DP inside it when no bound in it can
    improve on the best found below it (the plain scan changes its answer only on a
    strict improvement, so the answer, stages included, is the plain scan's):

    * the DP finds no pipeline at b: then none at any lower bound either (a lower bound
      allows a subset of the stages);
    * ``F(b) + (B - 1) * a >= best``, where ``F(t)`` is the least sum of stage latencies
      under bound t (``F`` never increases with t, each pipeline's sum is added up in
      the same order whatever the bound). A pipeline found at t in [a, b] with its
      largest stage m >= a totals at least that. One with m < a was found with the same
      sum at bound m already (run or passed over for the same reason), with at most that
      total; unless m was left out as within epsilon of a smaller bound, so the bound
      uses ``min(a, smallest value left out)``.

    ``run`` returns (total, stages, DP runs, candidates compared) of the answer, or None."""

    def __init__(self, C, sizes, D, S, B, bounds, dropped_low):
        self.C, self.sizes, self.D, self.S, self.B = C, sizes, D, S, B
        self.bounds, self.dropped_low = bounds, dropped_low
        self.found: dict[int, tuple | None] = {}
        self.best: tuple[float, float, list] | None = None     # (total, sum, stages)
        self.stopped = False
        self.compared = [0]      # (i, j, d) candidates the DP runs built

    def _dp(self, n: int):
        if n not in self.found:
            self.found[n] = _dp_for_bound(self.C, self.sizes, self.D, self.S, self.bounds[n],
                                          self.compared)
        return self.found[n]

    def run(self):
        self._visit(0, len(self.bounds) - 1)
        if self.best is None:
            return None
        return self.best[0], self.best[2], len(self.found), self.compared[0]

    def _visit(self, lo: int, hi: int) -> None:
        """Bounds lo..hi in the plain scan's order, skipping what cannot improve."""
        if self.stopped:
            return
        best = self.best
        if best is not None and (self.B - 1) * self.bounds[lo] >= best[0]:
            self.stopped = True     # the plain scan stops here: no later bound can win
            return
        found = self._dp(hi)
        if found is None:
            return
        if best is not None and \
                found[0] + (self.B - 1) * min(self.bounds[lo], self.dropped_low) >= best[0]:
            return
        if lo == hi:
            total = found[0] + (self.B - 1) * max(st[3] for st in found[1])
            if best is None or total < best[0]:
                self.best = (total, found[0], found[1])
            return
        mid = (lo + hi) // 2
        self._visit(lo, mid)
        self._visit(mid + 1, hi)


def _dp_for_bound(C: np.ndarray, sizes: np.ndarray, D: int, S: int, t_max: float,
                  compared: list[int]):
    """Min total latency under the bound, with the stages that reach it (or None).

    ``F[s, k, d] = min over (i, j) of C[k, i, j, s-1] + F[s-1, i+1, d - size_j]``, for all
    d at once per (s, k); ``argmin`` keeps the first (i, j) in (i, j) order among equal
    values, as a scan updating only on a strict improvement would.

    Only the (k, i) that can end in a pipeline are built: a stage is at least one layer,
    so ``F[s, k]`` is finite only for ``k <= L - s``, and row k of stage count s reads
    ``i`` in ``k .. L - s`` (``C`` is inf below ``i = k``, ``F[s-1, i+1]`` beyond
    ``L - s``). Every entry left out is inf, so the first least (i, j) is the one the
    full (L x L x J) candidate array gives, at about a fifth of its size for L = S (target
    b's 16 layers: 816 of 4096 (k, i) blocks; the DP was a third of that search's stage
    phase). ``compared[0]`` counts the candidates built."""
    L, _, J, _ = C.shape
    F = np.full((S + 1, L + 1, D + 1), np.inf)
    choice = np.full((S + 1, L + 1, D + 1, 2), -1, dtype=np.int64)   # (i, j)
    F[0, L, 0] = 0.0
    allowed = np.where(C <= t_max, C, np.inf)
    src = np.arange(D + 1)[None, :] - sizes[:, None]     # (J, D+1): d - size_j
    reach = src >= 0
    src = np.where(reach, src, 0)
    for s in range(1, S + 1):
        rest = F[s - 1, 1:]                               # rest[i] = F[s-1, i+1]
        if not np.isfinite(rest).any():
            continue
        last = L - s                                      # the last i (and k) that can end
        shifted = np.where(reach[None], rest[:last + 1, src], np.inf)   # (i, j, d)
        for k in range(last + 1):
            cand = (allowed[k, k:last + 1, :, s - 1, None] + shifted[k:]).reshape(
                (last + 1 - k) * J, D + 1)
            compared[0] += cand.size
            arg = cand.argmin(axis=0)
            val = cand[arg, np.arange(D + 1)]
            ok = np.isfinite(val)
            F[s, k] = val
            choice[s, k, :, 0] = np.where(ok, k + arg // J, -1)
            choice[s, k, :, 1] = np.where(ok, arg % J, -1)
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
