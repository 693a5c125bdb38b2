"""The layout a value crossing pipeline stages is sent and received in.

An activation (or its gradient) crossing every micro-batch goes with its batch (dim 0)
split over the first axis of the stage meshes, as each data-parallel replica computed
it, where both stages agree on it: the sender's ILP lays the send out that way (no
gather over that axis) and the receiver's takes it so (each rank its own block, read
by its ops as any other layout). Which values may cross so is the stage graph's
``meta["batch_split"]`` (``passes/pipeline_search/subgraph.py``: the batch-first
values, named as sent and as received); the pipeline's assembly keeps there only those
whose two stages have the same logical mesh (``passes/pipeline_search/stage_transfers.
batch_splits``), and the runtime sends each rank's block to the rank at its position
(``runtime/execution/pipeline.py``). Any other value crosses whole.
"""

from __future__ import annotations

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph, TensorSpec
from torchalpa.core.placement import Placements, Replicate, Shard

__all__ = ["boundary_layout", "batch_split_of", "summed_part"]


def batch_split_of(spec: TensorSpec, mesh_shape) -> int:
    """Blocks a batch-first value of ``spec`` crosses in on a mesh of ``mesh_shape``: its
    first axis, where that splits dim 0 evenly; 1 (whole) otherwise."""
    n = mesh_shape[0] if len(mesh_shape) else 1
    return n if n > 1 and spec.shape and spec.shape[0] % n == 0 else 1


def boundary_layout(graph: OpGraph, name: str, spec: TensorSpec, mesh: LogicalMesh
                    ) -> Placements | None:
    """The layout value ``name`` (a send's ``str(ref)`` or a received leaf's name) crosses
    in on ``mesh``: dim 0 split over axis 0, replicated over the others; None: whole."""
    if name not in graph.meta.get("batch_split", ()) or batch_split_of(spec, mesh.shape) == 1:
        return None
    return (Shard(0),) + tuple(Replicate() for _ in mesh.shape[1:])


def summed_part(graph: OpGraph, name: str) -> bool:
    """Whether leaf ``name`` is a gradient part another stage sends summed once per step:
    a received backward value only added into parameters' gradients
    (``pipeline_search.subgraph.once_per_step``). The runtime receives it whole, after the
    stage's last backward (``runtime/execution/pipeline.py``, ``StageExchange.finish``),
    and lays it out as the add reads it."""
    node = graph.node(name)
    if node.kind != "input" or node.phase != "backward":
        return False
    readers = graph.consumers(name)
    grads = {ref.node for _, ref in graph.outputs.grads}
    return bool(readers) and all(graph.node(c).op == "aten.add.Tensor" and c in grads
                                 for c in readers)
