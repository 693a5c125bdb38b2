"""Which steps each parallel method takes: the table ``torchalpa.plan`` and
``torchalpa.auto_parallel`` dispatch through (never ``isinstance`` branches in the API).

A method's presets (``DataParallel``, ``Zero2Parallel``, ``Zero3Parallel`` are
``ShardParallel`` with other defaults) find their steps through their base class.
"""

from __future__ import annotations

from torchalpa.core.options import AutoParallel, PipeshardParallel, ShardParallel
from torchalpa.parallel.auto import AutoSteps
from torchalpa.parallel.pipeshard import PipelineSteps
from torchalpa.parallel.shard import IntraOpSteps
from torchalpa.parallel.steps import MethodSteps

__all__ = ["STEPS", "steps_of"]

STEPS: dict[type, MethodSteps] = {
    AutoParallel: AutoSteps(),
    ShardParallel: IntraOpSteps(),
    PipeshardParallel: PipelineSteps(),
}


def steps_of(method) -> MethodSteps:
    """The steps of ``method``'s class (or of the nearest base class in the table)."""
    for cls in type(method).__mro__:
        if cls in STEPS:
            return STEPS[cls]
    raise TypeError(f"method must be a torchalpa method such as AutoParallel() (the "
                    f"default), ShardParallel() or PipeshardParallel(), got "
                    f"{type(method).__name__}")
