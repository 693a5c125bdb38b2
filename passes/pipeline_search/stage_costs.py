"""Additive stage estimates: a range of layers on a submesh, priced from its layers' plans.

A range of layers costs the sum of its layers' step times (``passes/pipeline_search/layer_costs.py``) on
one view of the submesh, plus sending its boundary values to the neighbouring stages; its
memory is the layers' model states, one micro-batch at its peak and what forward saved
for every other micro-batch in flight (1F1B keeps one per stage still ahead, GPipe all).
Each view offers the fastest plan and, where that does not fit, the lean one (parameters
sharded); each also recomputed, where the method lets the search choose that
(``passes/pipeline_search/stage_recompute.py``). The stage DP starts from these sums; the stages it picks are
then priced exactly (``passes/pipeline_search/exact_stages.py``).
"""

from __future__ import annotations

import math

from torchalpa.passes.pipeline_search.layer_costs import Estimate, LayerCosts, stage_memory
from torchalpa.passes.pipeline_search.search_problem import SearchProblem
from torchalpa.passes.pipeline_search.stage_recompute import (
    FORWARD_SHARE,
    received_bytes,
    recompute_memory,
    stage_recompute_allowed,
)
from torchalpa.passes.pipeline_search.stage_transfers import once_per_step

__all__ = ["StageCosts", "Candidate", "Variant"]

View = tuple[int, ...]
Submesh = tuple[int, int]
Variant = tuple[View, bool, bool]
"""How a stage is planned: (logical view, lean, recompute)."""
Candidate = tuple[float, float, View, bool, bool]
"""(latency, additive memory, view, lean, recompute) of a stage."""


class StageCosts:
    """Additive estimates of a range of layers on each submesh view (see module doc)."""

    def __init__(self, problem: SearchProblem, layers: LayerCosts):
        self.problem, self.layers = problem, layers
        # each stage also priced with its activations recomputed (passes/pipeline_search/stage_recompute.py)
        self.stage_recompute = stage_recompute_allowed(problem.method, problem.graph)
        self.send_bytes = self._boundary_bytes()
        self._received: dict[tuple[int, int], float] = {}

    def received(self, k: int, i: int) -> float:
        """Forward bytes layers k..i receive from earlier layers per micro-batch."""
        if (k, i) not in self._received:
            layer = self.problem.layer
            self._received[k, i] = received_bytes(
                self.problem.graph, lambda name: k <= layer[name] <= i)
        return self._received[k, i]

    def _boundary_bytes(self) -> list[float]:
        """Bytes crossing the cut after layer l (both directions, one micro-batch)."""
        graph, layer = self.problem.graph, self.problem.layer
        out = [0.0] * self.problem.num_layers
        seen = set()
        for node in graph.ops():
            for ref in node.operands:
                a, b = layer[ref.node], layer[node.name]
                # the batch is on every stage; parameters (and gradient parts only summed
                # into a parameter's gradient) cross once per step, not per micro-batch
                if a != b and graph.node(ref.node).kind != "input" and (ref, b) not in seen \
                        and not once_per_step(graph, ref, layer, b):
                    seen.add((ref, b))
                    for cut in range(min(a, b), max(a, b)):
                        out[cut] += graph.spec(ref).nbytes
        return out

    def send_seconds(self, k: int, i: int) -> float:
        """Seconds to send layers k..i's boundary values (one micro-batch, both ways)."""
        cluster = self.problem.cluster
        link = cluster.inter_node_bandwidth if cluster.num_nodes > 1 else \
            cluster.intra_node_bandwidth
        sends = (self.send_bytes[i] if i < self.problem.num_layers - 1 else 0.0) + \
            (self.send_bytes[k - 1] if k > 0 else 0.0)
        return sends / link

    def candidates(self, k: int, i: int, submesh: Submesh, in_flight_batches: int
                   ) -> list[Candidate]:
        """(latency, additive memory, view, lean, recompute) of layers k..i on each view of
        ``submesh``: the fastest plan, and the lean one where the fastest does not fit;
        each also with its activations recomputed where the search may choose that."""
        out = []
        sends = self.send_seconds(k, i)
        for view in self.layers.views(submesh):
            for lean in (False, True):
                found = [self.layers.layer_estimate(l, view, submesh, lean)
                         for l in range(k, i + 1)]
                parts = [p for p in found if p is not None]
                if len(parts) < len(found):
                    continue
                memory = stage_memory(parts, in_flight_batches)
                seconds = sum(p.seconds for p in parts)
                out.append((seconds + sends, memory, view, lean, False))
                if self.stage_recompute:
                    out.append(self._recomputed(k, i, parts, seconds + sends, view, lean,
                                                in_flight_batches))
                if memory <= self.problem.budget():
                    break
        return out

    def _recomputed(self, k: int, i: int, parts: list[Estimate], seconds: float, view: View,
                    lean: bool, in_flight_batches: int) -> Candidate:
        """The recomputed variant of a candidate: one more forward of its layers, and
        only the received activations kept for the micro-batches not at their peak."""
        compute = sum(p.seconds for p in parts)
        saved = sum(p.saved for p in parts)
        peak = saved + max(p.activations - p.saved for p in parts)
        memory = recompute_memory(sum(p.state for p in parts), peak, self.received(k, i),
                                  in_flight_batches)
        return seconds + compute * FORWARD_SHARE, memory, view, lean, True

    def cost(self, k: int, i: int, submesh: Submesh, in_flight_batches: int
             ) -> tuple[float, Variant | None]:
        """(latency, (best logical view, lean, recompute)) of layers k..i on ``submesh``,
        inf if none fits by the additive estimate."""
        budget = self.problem.budget()
        fits = [(t, (view, lean, recompute)) for t, memory, view, lean, recompute in
                self.candidates(k, i, submesh, in_flight_batches) if memory <= budget]
        return min(fits, key=lambda c: c[0]) if fits else (math.inf, None)
