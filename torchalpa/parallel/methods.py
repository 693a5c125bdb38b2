"""Which implementation each parallel method has for each kind of work: the tables
``torchalpa.plan`` and ``torchalpa.auto_parallel`` dispatch through (never ``isinstance``
branches in the API), one per protocol of ``torchalpa.parallel.steps``.

A method's presets (``DataParallel``, ``Zero2Parallel``, ``Zero3Parallel`` are
``ShardParallel`` with other defaults) find their implementations through their base
class. ``AutoParallel`` is a resolver: it is in no table of concrete work, and is resolved
to a concrete method first (by its search, or ``MethodResolver.concrete``).
"""

from __future__ import annotations

from typing import TypeVar

from torchalpa.core.options import AutoParallel, PipeshardParallel, ShardParallel
from torchalpa.parallel.auto import AutoResolver
from torchalpa.parallel.pipeshard import PipelineSteps
from torchalpa.parallel.shard import IntraOpSteps
from torchalpa.parallel.steps import (
    ConcreteMethod,
    GenerationSteps,
    MethodResolver,
    MethodSteps,
    ProgramSteps,
)

__all__ = ["STEPS", "RESOLVERS", "GENERATION", "PROGRAMS", "check_method", "steps_of",
           "resolver_of", "generation_steps_of", "program_steps_of"]

_INTRA_OP = IntraOpSteps()

STEPS: dict[type, MethodSteps] = {
    ShardParallel: _INTRA_OP,
    PipeshardParallel: PipelineSteps(),
}
RESOLVERS: dict[type, MethodResolver] = {AutoParallel: AutoResolver()}
GENERATION: dict[type, GenerationSteps] = {ShardParallel: _INTRA_OP}
PROGRAMS: dict[type, ProgramSteps] = {ShardParallel: _INTRA_OP}

_NOT_FOR_GENERATION = ("mode='inference' plans the decode and prefill steps on one mesh: use "
                       "ShardParallel (or a preset such as Zero3Parallel); pipelined "
                       "generation is not built")
_NOT_FOR_PROGRAMS = ("a JAX function or StableHLO program is planned whole with ShardParallel: "
                     "PipeshardParallel cuts a torch model's step into stages")

T = TypeVar("T")


def _lookup(table: dict[type, T], method: object) -> T | None:
    for cls in type(method).__mro__:
        if cls in table:
            return table[cls]
    return None


def check_method(method: object) -> None:
    """A TypeError naming the methods unless ``method`` is one."""
    if _lookup(STEPS, method) is None and _lookup(RESOLVERS, method) is None:
        raise TypeError(f"method must be a torchalpa method such as AutoParallel() (the "
                        f"default), ShardParallel() or PipeshardParallel(), got "
                        f"{type(method).__name__}")


def resolver_of(method: object) -> MethodResolver | None:
    """The resolver of a method that chooses a concrete one, else None."""
    return _lookup(RESOLVERS, method)


def steps_of(method: ConcreteMethod) -> MethodSteps:
    """The training steps of a concrete method (``AutoParallel`` is resolved first)."""
    found = _lookup(STEPS, method)
    if found is None:
        check_method(method)
        raise TypeError(f"{type(method).__name__} chooses a method: resolve it first "
                        "(resolver_of)")
    return found


def _concrete(method: object) -> object:
    resolver = resolver_of(method)
    if resolver is None:
        return method
    assert isinstance(method, AutoParallel)
    return resolver.concrete(method)


def generation_steps_of(method: object) -> tuple[ShardParallel, GenerationSteps]:
    """The method generation plans with (``AutoParallel``: its intra-op method) and its
    steps, or a ValueError naming the method to use."""
    check_method(method)
    method = _concrete(method)
    steps = _lookup(GENERATION, method)
    if steps is None:
        raise ValueError(_NOT_FOR_GENERATION)
    return steps.for_generation(method), steps


def program_steps_of(method: object) -> tuple[ShardParallel, ProgramSteps]:
    """The method a JAX function or StableHLO program is planned with and its steps, or a
    ValueError naming the method to use."""
    check_method(method)
    method = _concrete(method)
    steps = _lookup(PROGRAMS, method)
    if steps is None:
        raise ValueError(_NOT_FOR_PROGRAMS)
    assert isinstance(method, ShardParallel)
    return method, steps
