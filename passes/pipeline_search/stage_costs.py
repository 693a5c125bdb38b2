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
from dataclasses import replace

from torchalpa.core.cluster import LogicalMesh, Submesh, View
from torchalpa.core.opgraph import TensorSpec, ValueRef
from torchalpa.core.plan import Transfer
from torchalpa.passes.pipeline_search.layer_costs import Estimate, LayerCosts, stage_memory
from torchalpa.passes.pipeline_search.search_keys import Candidate, Variant
from torchalpa.passes.pipeline_search.search_problem import SearchProblem
from torchalpa.passes.pipeline_search.stage_recompute import (
    FORWARD_SHARE,
    received_bytes,
    recompute_memory,
    stage_recompute_allowed,
)
from torchalpa.passes.pipeline_search.stage_transfers import once_per_step, transfer_seconds
from torchalpa.passes.sharding.constraints import batch_dims
from torchalpa.passes.sharding.stage_boundary import batch_split_of

__all__ = ["StageCosts", "Candidate", "Variant"]



class StageCosts:
    """Additive estimates of a range of layers on each submesh view (see module doc)."""

    def __init__(self, problem: SearchProblem, layers: LayerCosts):
        self.problem, self.layers = problem, layers
        # each stage also priced with its activations recomputed (passes/pipeline_search/stage_recompute.py)
        self.stage_recompute = stage_recompute_allowed(problem.method, problem.graph)
        self.send_bytes = self._boundary_bytes()
        # of those, what forward sends on to a later layer (what a pipeline's schedule
        # waits on in both directions: ``pipeline_assembly.pipeline_estimates``)
        self.forward_bytes = self._boundary_bytes(forward=True)
        self._received: dict[tuple[int, int], float] = {}
        self._sends: dict[tuple[int, int], tuple] = {}   # (cut, id(mesh)) -> (mesh, seconds)

    def received(self, k: int, i: int) -> float:
        """Forward bytes layers k..i receive from earlier layers per micro-batch."""
        if (k, i) not in self._received:
            layer = self.problem.layer
            self._received[k, i] = received_bytes(
                self.problem.graph, lambda name: k <= layer[name] <= i)
        return self._received[k, i]

    def _boundary_bytes(self, forward: bool = False) -> list[list[tuple[TensorSpec, bool]]]:
        """The values crossing the cut after layer l (both directions, one micro-batch;
        ``forward``: only forward's values sent on to a later layer), each with whether
        its dim 0 is the batch."""
        graph, layer = self.problem.graph, self.problem.layer
        out: list[list[tuple[TensorSpec, bool]]] = [[] for _ in range(self.problem.num_layers)]
        batched = {ValueRef(n, i) for (n, i), dims in batch_dims(graph).items() if 0 in dims}
        seen = set()
        for node in graph.ops():
            for ref in node.operands:
                a, b = layer[ref.node], layer[node.name]
                # the batch is on every stage; parameters (and gradient parts only summed
                # into a parameter's gradient) cross once per step, not per micro-batch
                if a != b and graph.node(ref.node).kind != "input" and (ref, b) not in seen \
                        and not once_per_step(graph, ref, layer, b) and \
                        (not forward or (a < b and graph.node(ref.node).phase == "forward")):
                    seen.add((ref, b))
                    for cut in range(min(a, b), max(a, b)):
                        out[cut].append((graph.spec(ref), ref in batched))
        return out

    def send_seconds(self, k: int, i: int, mesh: LogicalMesh | None = None) -> float:
        """Seconds to send layers k..i's boundary values (one micro-batch, both ways) as
        the pipeline's assembly lays them out with the neighbours on the same logical
        ``mesh`` (``passes/pipeline_search/stage_transfers.py``): batch-first ones split
        over its first axis, each then sent whole or in chunks re-gathered over its last
        axis, whichever is cheaper; None: every value whole."""
        cluster = self.problem.cluster
        link = cluster.inter_node_bandwidth if cluster.num_nodes > 1 else \
            cluster.intra_node_bandwidth
        values = (self.send_bytes[i] if i < self.problem.num_layers - 1 else []) + \
            (self.send_bytes[k - 1] if k > 0 else [])
        if mesh is None:
            return sum(spec.nbytes for spec, _ in values) / link
        # each cut's values priced once per mesh, added up in the order above (the same
        # float sum): the DP's cost table asks for every range, O(L^2) per view
        seconds = 0.0
        for cut in ([i] if i < self.problem.num_layers - 1 else []) + ([k - 1] if k > 0 else []):
            for t in self._cut_seconds(cut, mesh, link):
                seconds += t
        return seconds

    def forward_seconds(self, cut: int, mesh: LogicalMesh) -> float:
        """Seconds to send forward's values crossing ``cut`` on to the layers after it
        (``forward_bytes``), priced as ``send_seconds`` prices each value on ``mesh``."""
        return sum(self._value_seconds(self.forward_bytes[cut], mesh, self._link()))

    def _link(self) -> float:
        cluster = self.problem.cluster
        return cluster.inter_node_bandwidth if cluster.num_nodes > 1 else \
            cluster.intra_node_bandwidth

    def _cut_seconds(self, cut: int, mesh: LogicalMesh, link: float) -> tuple[float, ...]:
        """Seconds of each value crossing ``cut`` (``send_bytes[cut]``'s order) on ``mesh``."""
        key = (cut, id(mesh))
        found = self._sends.get(key)
        if found is not None and found[0] is mesh:
            return found[1]
        out = self._value_seconds(self.send_bytes[cut], mesh, link)
        self._sends[key] = (mesh, tuple(out))     # the mesh kept: its id stays its own
        return self._sends[key][1]

    @staticmethod
    def _value_seconds(values: list[tuple[TensorSpec, bool]], mesh: LogicalMesh,
                       link: float) -> list[float]:
        """Seconds of each of ``values`` sent to a stage on ``mesh``: batch-first ones split
        over its first axis, each then whole or in chunks re-gathered over its last axis,
        whichever is cheaper."""
        out = []
        for spec, batched in values:
            split = batch_split_of(spec, mesh.shape) if batched else 1
            t = Transfer("", 0, 0, 0, "forward", spec.nbytes, batch_split=split)
            whole = transfer_seconds(t, [mesh], link)
            n = mesh.shape[mesh.ndim - 1]
            if n > 1 and (split == 1 or len(mesh.shape) > 1) and spec.numel // split % n == 0:
                whole = min(whole, transfer_seconds(replace(t, split=n), [mesh], link))
            out.append(whole)
        return out

    def candidates(self, k: int, i: int, submesh: Submesh, in_flight_batches: int
                   ) -> list[Candidate]:
        """(latency, additive memory, view, lean, recompute) of layers k..i on each view of
        ``submesh``: the fastest plan, and the lean one where the fastest does not fit;
        each also with its activations recomputed where the search may choose that."""
        out = []
        for view in self.layers.views(submesh):
            sends = self.send_seconds(k, i, self.problem.mesh(submesh, view))
            for lean in (False, True):
                found = [self.layers.layer_estimate(l, view, submesh, lean)
                         for l in range(k, i + 1)]
                parts = [p for p in found if p is not None]
                if len(parts) < len(found):
                    continue
                memory = stage_memory(parts, in_flight_batches)
                seconds = sum(p.seconds for p in parts)
                out.append(Candidate(seconds + sends, memory, view, lean, False))
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
        return Candidate(seconds + compute * FORWARD_SHARE, memory, view, lean, True)

    def cost(self, k: int, i: int, submesh: Submesh, in_flight_batches: int
             ) -> tuple[float, Variant | None]:
        """(latency, (best logical view, lean, recompute)) of layers k..i on ``submesh``,
        inf if none fits by the additive estimate."""
        budget = self.problem.budget()
        fits = [(c.latency, c.variant) for c in self.candidates(k, i, submesh, in_flight_batches)
                if c.memory <= budget]
        return min(fits, key=lambda c: c[0]) if fits else (math.inf, None)
