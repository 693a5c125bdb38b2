"""What the pipeline search plans, and what follows from it once.

The layer estimates (``passes/pipeline_search/layer_costs.py``), the stage estimates
(``passes/pipeline_search/stage_costs.py``) and the exact stage solves (``passes/pipeline_search/exact_stages.py``) all
read the same step: its graph cut into layers, the cluster, the method and how inputs are
given. ``SearchProblem`` holds them with what is derived from them once: each layer's
structural signature (identical layers share one), every dim size of the step (which
views can shard anything), and the part of every cached solve's key they decide.
"""

from __future__ import annotations

from torchalpa.core.cluster import Cluster, LogicalMesh
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import PipeshardParallel
from torchalpa.passes.pipeline_search.layer_cache import layer_signatures, range_signature
from torchalpa.passes.pipeline_search.subgraph import stage_subgraph
from torchalpa.passes.pipeline_search.submesh_views import submesh_cluster, tensor_dims

__all__ = ["SearchProblem"]


class SearchProblem:
    """The step ``graph`` (one micro-batch) cut into layers (``layer``: node -> layer),
    planned with ``method`` on ``cluster``; ``inputs``: "global" or "local" batches."""

    def __init__(self, graph: OpGraph, layer: dict[str, int], cluster: Cluster,
                 method: PipeshardParallel, inputs: str):
        self.graph, self.layer, self.cluster, self.method = graph, layer, cluster, method
        self.inputs = inputs
        self.num_layers = max(layer.values()) + 1
        self.signature = layer_signatures(graph, layer, self.num_layers)
        self.dims = tensor_dims(graph)
        self._meshes: dict[tuple, LogicalMesh] = {}
        # everything besides the layers' structure and the view that decides a solve (the
        # micro-batches too: a stage's ILP weighs its gradients' reduction against them)
        self.context = (repr(cluster), repr(method.intra_op_method(None)), inputs,
                        method.num_micro_batches)

    def budget(self) -> float:
        """Memory per device a stage may use: the method's budget, else the device's."""
        return self.method.auto_sharding_option.memory_budget_per_device or \
            self.cluster.memory_per_device

    def mesh(self, submesh: tuple[int, int], view: tuple[int, ...]) -> LogicalMesh:
        """``submesh`` of the cluster as the logical mesh ``view`` (made once per pair: the
        stage DP asks for every range on every view)."""
        key = (submesh, view)
        found = self._meshes.get(key)
        if found is None:
            found = self._meshes[key] = submesh_cluster(self.cluster, submesh).logical_mesh(view)
        return found

    def stage_graph(self, first: int, last: int) -> OpGraph:
        """Layers ``first..last`` as one stage's own graph."""
        stage_of = {n: (0 if first <= at <= last else 1) for n, at in self.layer.items()}
        return stage_subgraph(self.graph, stage_of, 0).graph

    def range_shape(self, first: int, last: int) -> tuple:
        """What decides a range of layers' stage plan besides where it runs: its layers'
        structure and whether it holds the first layer (reads the batch) or the last
        (makes the loss). Ranges of identical layers at other depths share it."""
        return (range_signature(self.signature, first, last), first == 0,
                last == self.num_layers - 1)
