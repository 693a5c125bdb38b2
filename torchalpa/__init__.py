"""torchalpa: Alpa's automatic parallelization for PyTorch.

    pmodel = torchalpa.auto_parallel(model, example_inputs=(x, y), loss_fn=loss_fn)
    loss = pmodel(x, y); loss.backward(); opt.step()

See README.md and ../shared/DESIGN.md for the architecture.
"""

from torchalpa.cluster import Cluster, LogicalMesh
from torchalpa.methods import (AutoLayerOption, AutoShardingOption, DataParallel,
                               ManualShardingOption,
                               ManualStageOption, PipeshardParallel, ShardParallel,
                               UniformStageOption, Zero2Parallel, Zero3Parallel)
from torchalpa.placement import Partial, Replicate, Shard
from torchalpa.plan import PipelinePlan, Plan, load_plan
from torchalpa.api import auto_parallel, plan
from torchalpa.markers import mark_pipeline_boundary
from torchalpa.runtime.checkpoint import load_checkpoint, save_checkpoint
from torchalpa.runtime.faults import RankFailedError
from torchalpa.runtime.precision import MixedPrecision

__version__ = "0.1.0"

__all__ = [
    "auto_parallel", "plan", "Plan", "Cluster", "LogicalMesh", "ShardParallel", "DataParallel",
    "Zero2Parallel", "Zero3Parallel", "AutoShardingOption", "ManualShardingOption", "Shard", "Replicate", "Partial",
    "mark_pipeline_boundary", "PipeshardParallel", "AutoLayerOption", "ManualStageOption",
    "UniformStageOption", "PipelinePlan", "load_plan", "MixedPrecision", "save_checkpoint",
    "load_checkpoint", "RankFailedError",
]
