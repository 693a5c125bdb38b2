"""Parallelization methods and their options (validated, frozen dataclasses).

``ShardParallel`` is Alpa's intra-op auto-sharding: the ILP decides every layout.
The options mirror Alpa's ``AutoShardingOption`` where they mean the same thing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["AutoShardingOption", "ShardParallel", "OPTIMIZER_STATES"]

# Optimizer state tensors kept per parameter element, for the memory model.
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "adagrad": 1,
                    "rmsprop": 1}


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoShardingOption:
    """Knobs of the intra-op ILP."""

    solver: str = "cbc"
    """'cbc' (ships with pulp) or 'highs' (needs highspy)."""
    time_limit: float | None = 60.0
    """Seconds the solver may take; the best plan found by then is used."""
    gap: float | None = None
    """Relative optimality gap at which the solver may stop (None: solver default)."""
    memory_budget_per_device: float | None = None
    """Bytes per device the plan must fit in (None: the cluster's device memory)."""

    def __post_init__(self):
        if self.solver not in ("cbc", "highs"):
            raise ValueError(f"AutoShardingOption.solver must be 'cbc' or 'highs', "
                             f"got {self.solver!r}")
        if self.time_limit is not None and self.time_limit <= 0:
            raise ValueError(f"AutoShardingOption.time_limit must be > 0 seconds, "
                             f"got {self.time_limit}")
        if self.gap is not None and not 0 <= self.gap < 1:
            raise ValueError(f"AutoShardingOption.gap must be in [0, 1), got {self.gap}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardParallel:
    """Intra-operator parallelism chosen by Alpa's ILP over one logical mesh."""

    logical_mesh_shape: tuple[int, ...] | None = None
    """Shape of the logical mesh; None views all devices as one 1D mesh."""
    auto_sharding_option: AutoShardingOption = field(default_factory=AutoShardingOption)
    optimizer: str = "adam"
    """Optimizer whose states the memory model counts (see OPTIMIZER_STATES)."""

    def __post_init__(self):
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"ShardParallel.optimizer must be one of "
                             f"{sorted(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        if self.logical_mesh_shape is not None:
            shape = tuple(int(s) for s in self.logical_mesh_shape)
            if not shape or any(s < 1 for s in shape):
                raise ValueError(f"ShardParallel.logical_mesh_shape must be positive ints, "
                                 f"got {self.logical_mesh_shape}")
            object.__setattr__(self, "logical_mesh_shape", shape)

    @property
    def optimizer_states(self) -> int:
        return OPTIMIZER_STATES[self.optimizer]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["name"] = type(self).__name__
        return d
