"""torchalpa: Alpa's automatic parallelization for PyTorch.

    pmodel = torchalpa.auto_parallel(model, example_inputs=(x, y), loss_fn=loss_fn)
    loss = pmodel(x, y); loss.backward(); opt.step()

See README.md and ../shared/DESIGN.md for the architecture.
"""

from torchalpa.cluster import Cluster, LogicalMesh
from torchalpa.methods import (AutoShardingOption, DataParallel, ShardParallel, Zero2Parallel,
                               Zero3Parallel)
from torchalpa.placement import Partial, Replicate, Shard
from torchalpa.plan import Plan
from torchalpa.api import auto_parallel, plan
from torchalpa.markers import mark_pipeline_boundary

__version__ = "0.1.0"

__all__ = [
    "auto_parallel", "plan", "Plan", "Cluster", "LogicalMesh", "ShardParallel", "DataParallel",
    "Zero2Parallel", "Zero3Parallel", "AutoShardingOption", "Shard", "Replicate", "Partial",
    "mark_pipeline_boundary",
]
