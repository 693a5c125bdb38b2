"""torchalpa: Alpa's automatic parallelization for PyTorch.

    pmodel = torchalpa.auto_parallel(model, example_inputs=(x, y), loss_fn=loss_fn)
    loss = pmodel(x, y); loss.backward(); opt.step()

The public names are imported on first use (below). The packages, one floor down:

- ``core``: the IR and records every layer shares (op graph, placements, plans, clusters).
- ``ops``: custom torch ops (attention, batched matmul, the pipeline marker).
- ``frontends`` / ``passes`` / ``runtime``: capture, planning and execution (installed
  from the repository's top-level folders).
- ``parallel``: the entry points and the one orchestration every method goes through.
- ``interop``: StableHLO, XLA/JAX shardings and torch's tensor-parallel plans.
- ``views``: plans for people (summaries, pictures, traces).
- ``models``: the model zoo; ``suite``: models torchalpa was not written for, as fixtures.
- ``cli``: the ``torchalpa`` command.

See README.md for using it and docs/architecture.md for how it is built.
"""

import importlib
from typing import TYPE_CHECKING

from torchalpa.core.view_registry import add_view_loader


def _load_views() -> None:
    """The views register themselves with Plan (summary, explain, to_html, to_tp_plan...)
    when one is first asked for (``torchalpa.core.view_registry``)."""
    importlib.import_module("torchalpa.views")
    importlib.import_module("torchalpa.interop.tp_plan")


add_view_loader(_load_views)

if TYPE_CHECKING:
    from torch.distributed.tensor import Partial, Replicate, Shard

    from torchalpa.core.cluster import Cluster, LogicalMesh
    from torchalpa.core.options import (
        AutoLayerOption,
        AutoParallel,
        AutoShardingOption,
        DataParallel,
        Inference,
        ManualShardingOption,
        ManualStageOption,
        PipeshardParallel,
        ShardParallel,
        UniformStageOption,
        Zero1Parallel,
        Zero2Parallel,
        Zero3Parallel,
    )
    from torchalpa.core.plan import PipelinePlan, Plan, load_plan
    from torchalpa.interop.stablehlo_export import export_stablehlo
    from torchalpa.ops.markers import mark_pipeline_boundary
    from torchalpa.parallel.api import auto_parallel, plan
    from torchalpa.parallel.meta_model import to_meta
    from torchalpa.runtime.execution.mesh import shutdown
    from torchalpa.runtime.execution.precision import MixedPrecision
    from torchalpa.runtime.lowering.strided_dtensor import full_tensor
    from torchalpa.runtime.measurement.tensorboard import TensorBoardHook
    from torchalpa.runtime.resilience.rank_failure import RankFailedError
    from torchalpa.runtime.state.checkpoint import load_checkpoint, save_checkpoint
    from torchalpa.runtime.state.pretrained_load import load_pretrained
    from torchalpa.runtime.state.pretrained_save import save_pretrained

__version__ = "0.1.0"

# Every name is imported on first use (PEP 562), so that `import torchalpa.passes.sharding.ilp` (or
# any pass) loads neither torch nor torch.distributed, and `torchalpa --help` loads nothing.
_OPTIONS = ("AutoLayerOption", "AutoParallel", "AutoShardingOption", "DataParallel", "Inference",
            "ManualShardingOption", "ManualStageOption", "PipeshardParallel", "ShardParallel",
            "UniformStageOption", "Zero1Parallel", "Zero2Parallel", "Zero3Parallel")
_LAZY = {
    **dict.fromkeys(_OPTIONS, "torchalpa.core.options"),
    "Cluster": "torchalpa.core.cluster", "LogicalMesh": "torchalpa.core.cluster",
    "Plan": "torchalpa.core.plan", "PipelinePlan": "torchalpa.core.plan",
    "load_plan": "torchalpa.core.plan",
    "auto_parallel": "torchalpa.parallel.api", "plan": "torchalpa.parallel.api",
    "mark_pipeline_boundary": "torchalpa.ops.markers",
    "save_checkpoint": "torchalpa.runtime.state.checkpoint",
    "load_checkpoint": "torchalpa.runtime.state.checkpoint",
    "RankFailedError": "torchalpa.runtime.resilience.rank_failure",
    "save_pretrained": "torchalpa.runtime.state.pretrained_save",
    "load_pretrained": "torchalpa.runtime.state.pretrained_load",
    "export_stablehlo": "torchalpa.interop.stablehlo_export",
    "MixedPrecision": "torchalpa.runtime.execution.precision",
    "TensorBoardHook": "torchalpa.runtime.measurement.tensorboard",
    "to_meta": "torchalpa.parallel.meta_model",
    "shutdown": "torchalpa.runtime.execution.mesh",
    "full_tensor": "torchalpa.runtime.lowering.strided_dtensor",
    # torch's own classes: torchalpa.Shard is torch.distributed.tensor.Shard
    "Shard": "torchalpa.core.placement", "Replicate": "torchalpa.core.placement",
    "Partial": "torchalpa.core.placement",
}

def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchalpa' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "auto_parallel", "plan", "Plan", "Cluster", "AutoParallel", "LogicalMesh", "ShardParallel", "DataParallel",
    "Zero1Parallel", "Zero2Parallel", "Zero3Parallel", "AutoShardingOption",
    "ManualShardingOption", "Shard", "Replicate", "Partial",
    "mark_pipeline_boundary", "PipeshardParallel", "AutoLayerOption", "ManualStageOption",
    "UniformStageOption", "PipelinePlan", "load_plan", "MixedPrecision", "save_checkpoint",
    "load_checkpoint", "RankFailedError", "save_pretrained", "load_pretrained",
    "export_stablehlo", "TensorBoardHook", "to_meta", "shutdown", "Inference",
    "full_tensor",
]
