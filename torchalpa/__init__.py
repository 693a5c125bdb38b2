"""torchalpa: Alpa's automatic parallelization for PyTorch.

    pmodel = torchalpa.auto_parallel(model, example_inputs=(x, y), loss_fn=loss_fn)
    loss = pmodel(x, y); loss.backward(); opt.step()

See README.md and ../shared/DESIGN.md for the architecture.
"""

import importlib
from typing import TYPE_CHECKING

from torchalpa.cluster import Cluster, LogicalMesh
from torchalpa.methods import (AutoLayerOption, AutoShardingOption, DataParallel,
                               ManualShardingOption,
                               ManualStageOption, PipeshardParallel, ShardParallel,
                               UniformStageOption, Zero2Parallel, Zero3Parallel)
from torchalpa.plan import PipelinePlan, Plan, load_plan

if TYPE_CHECKING:
    from torch.distributed.tensor import Partial, Replicate, Shard

    from torchalpa.api import auto_parallel, plan
    from torchalpa.export import export_stablehlo
    from torchalpa.markers import mark_pipeline_boundary
    from torchalpa.runtime.checkpoint import load_checkpoint, save_checkpoint
    from torchalpa.runtime.export import save_pretrained
    from torchalpa.runtime.pretrained import load_pretrained
    from torchalpa.runtime.faults import RankFailedError
    from torchalpa.runtime.precision import MixedPrecision
    from torchalpa.runtime.tensorboard import TensorBoardHook
    from torchalpa.runtime.mesh import shutdown
    from torchalpa.meta_model import to_meta

__version__ = "0.1.0"

# Names that need torch or the runtime are imported on first use (PEP 562), so that
# `import torchalpa.passes.ilp` (or any pass) loads neither torch nor torch.distributed.
_LAZY = {
    "auto_parallel": "torchalpa.api", "plan": "torchalpa.api",
    "mark_pipeline_boundary": "torchalpa.markers",
    "save_checkpoint": "torchalpa.runtime.checkpoint",
    "load_checkpoint": "torchalpa.runtime.checkpoint",
    "RankFailedError": "torchalpa.runtime.faults",
    "save_pretrained": "torchalpa.runtime.export",
    "load_pretrained": "torchalpa.runtime.pretrained",
    "export_stablehlo": "torchalpa.export",
    "MixedPrecision": "torchalpa.runtime.precision",
    "TensorBoardHook": "torchalpa.runtime.tensorboard",
    "to_meta": "torchalpa.meta_model",
    "shutdown": "torchalpa.runtime.mesh",
    # torch's own classes: torchalpa.Shard is torch.distributed.tensor.Shard
    "Shard": "torchalpa.placement", "Replicate": "torchalpa.placement",
    "Partial": "torchalpa.placement",
}
# Importing the submodule torchalpa.plan above bound the name `plan` to it; the public
# `torchalpa.plan` is the function (torchalpa.api.plan), served by __getattr__ below.
if not TYPE_CHECKING:
    del plan


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchalpa' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "auto_parallel", "plan", "Plan", "Cluster", "LogicalMesh", "ShardParallel", "DataParallel",
    "Zero2Parallel", "Zero3Parallel", "AutoShardingOption", "ManualShardingOption", "Shard", "Replicate", "Partial",
    "mark_pipeline_boundary", "PipeshardParallel", "AutoLayerOption", "ManualStageOption",
    "UniformStageOption", "PipelinePlan", "load_plan", "MixedPrecision", "save_checkpoint",
    "load_checkpoint", "RankFailedError", "save_pretrained", "load_pretrained",
    "export_stablehlo", "TensorBoardHook", "to_meta", "shutdown",
]
