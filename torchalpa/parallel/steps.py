"""What the one orchestration (``torchalpa.parallel.build``) asks of a parallel method.

A method class (``ShardParallel``, ``PipeshardParallel``...) is plain data. What it is
asked depends on the kind of work, one narrow protocol each; ``torchalpa.parallel.methods``
holds the table of each and resolves a method to the implementation:

- ``MethodSteps``: a concrete method plans and places a training step: which meshes or
  submeshes are candidates (``target``), how one captured step is solved (``solve``), how a
  plan becomes this rank's program and state (``place``).
- ``MethodResolver``: a method that chooses among the concrete ones (``AutoParallel``)
  searches for a plan of a concrete method; the orchestration then goes on with that
  method's ``MethodSteps``. It also names the concrete method for work it does not
  choose for (generation, programs).
- ``GenerationSteps``: a method that plans generation's forward-only steps (the decode
  step, the prefill pinned to its layouts) and places them.
- ``ProgramSteps``: a method that plans a JAX function or StableHLO program whole.

A method that does not do a kind of work is simply not in that table: the lookup says so
in one line naming the method to use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from torchalpa.core.calls import CallSignature
from torchalpa.core.cluster import Cluster, LogicalMesh
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import AutoParallel, PipeshardParallel, ShardParallel
from torchalpa.core.plan import PipelinePlan, Plan

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.fx import GraphModule

    from torchalpa.runtime.lowering.rank_programs import StepPrograms
    from torchalpa.runtime.serving.inference import ForwardPrograms

__all__ = ["MethodSteps", "MethodResolver", "SearchTarget", "GenerationSteps", "ProgramSteps", "Placed",
           "PlacedForward", "ConcreteMethod", "AnyPlan"]

ConcreteMethod = ShardParallel | PipeshardParallel
"""A method that is planned (``AutoParallel`` resolves to one of these)."""
AnyPlan = Plan | PipelinePlan


@dataclass
class Placed:
    """This rank's part of a plan, ready to run: what ``MethodSteps.place`` returns."""

    program: StepPrograms
    """The programs a step runs (``runtime.lowering.rank_programs.StepPrograms``; ``compiled()`` gives
    them under ``torch.compile``)."""
    mesh: DeviceMesh
    """This rank's DeviceMesh (its stage's, in a pipeline)."""
    distribute: Callable[[Callable | None], None]
    """Swap the model's parameters and buffers for this rank's DTensor shards
    (``init_weights`` given: initialize a meta model's blocks with it)."""
    num_micro_batches: int
    stage: int = 0
    runner_options: dict = field(default_factory=dict)
    """Keywords of ``StepRunner`` beyond the program and the micro-batch count."""
    forward_programs: ForwardPrograms | None = None
    """Forward-only programs (predict, eval), or None where the method has none."""
    description: str = ""
    """One line for the log: what this rank runs."""


@dataclass
class PlacedForward:
    """Where forward-only programs of a plan run (generation's prefill and decode steps):
    what ``GenerationSteps.place_forward`` returns."""

    mesh: DeviceMesh
    """This rank's DeviceMesh."""
    lower: Callable[[GraphModule, Plan, list[str]], GraphModule]
    """``lower(gm, plan, buffer_updates)``: a captured forward step (``capture_forward``)
    as this rank's program ``(*state blocks, *inputs) -> (result, *new buffer blocks)``."""


class MethodSteps(Protocol):
    """A concrete method's steps of planning and placing a training step (module doc).
    ``target`` is the method's own record of what it plans for (``IntraOpTarget``, a
    ``Cluster``): the orchestration hands it back to the same steps unread."""

    def with_options(self, method, *, inputs: str = "global",
                     signature: CallSignature | None = None, mesh: DeviceMesh | None = None,
                     num_micro_batches: int | None = None,
                     init_weights: Callable | None = None) -> ConcreteMethod:
        """``method`` with ``auto_parallel``'s options applied, or a ValueError naming an
        option the method cannot honour and what to do instead."""
        ...

    def target(self, method, *, cluster: Cluster | LogicalMesh | None,
               mesh: DeviceMesh | None, world: int, live: bool) -> object:
        """What the method plans for: candidate logical meshes, or a cluster to cut into
        submeshes. ``live``: under ``auto_parallel``, every rank of the job is here (the
        mesh must fit the world; with no cluster given, the live process group may be
        calibrated, which is collective); False: planning without processes."""
        ...

    def solve(self, graph: OpGraph, target, method, inputs: str,
              measured: object = None) -> AnyPlan:
        """The plan of one captured step (cached where the method caches)."""
        ...

    def measure(self, captured, target, method, example_inputs: Sequence[torch.Tensor],
                model: torch.nn.Module, device: torch.device) -> object:
        """Measurements the solve needs from this job's devices (collective), or None."""
        ...

    def check_plan_kind(self, plan: object) -> None:
        """TypeError/ValueError unless ``plan`` is a plan of this method's kind."""
        ...

    def check_given_plan(self, plan, graph: OpGraph, target) -> None:
        """A ``plan=`` is checked like a cached one: step, mesh, shapes and layouts."""
        ...

    def place(self, captured, plan, target, method, device: torch.device, *,
              model: torch.nn.Module, traced: torch.nn.Module, loss_fn: Callable | None,
              inputs: str, signature: CallSignature | None) -> Placed:
        """This rank's mesh, lowered program and state placement. ``model``: the user's
        module (whose state is distributed); ``traced``: what was captured (the model, or
        it computing in a narrower dtype)."""
        ...


class SearchTarget(Protocol):
    """What a resolver's search plans for: at least the cluster, which the concrete
    method's steps then plan the chosen method for."""

    @property
    def cluster(self) -> Cluster | LogicalMesh: ...


class MethodResolver(Protocol):
    """A method that chooses a concrete one (``AutoParallel``): it searches, and the
    orchestration goes on with the plan's method (``core.options.method_of_plan``)."""

    def with_options(self, method: AutoParallel, *, inputs: str = "global",
                     signature: CallSignature | None = None, mesh: DeviceMesh | None = None,
                     num_micro_batches: int | None = None,
                     init_weights: Callable | None = None) -> AutoParallel:
        """``method`` narrowed by ``auto_parallel``'s options, or a ValueError."""
        ...

    def target(self, method: AutoParallel, *, cluster: Cluster | LogicalMesh | None,
               mesh: DeviceMesh | None, world: int, live: bool) -> SearchTarget:
        """What the search plans for (``MethodSteps.target``)."""
        ...

    def search(self, model: torch.nn.Module, example_inputs: Sequence[torch.Tensor],
               loss_fn: Callable | None, *, method: AutoParallel, target, inputs: str,
               signature: CallSignature | None = None, captures: dict | None = None
               ) -> AnyPlan:
        """The plan of the concrete method chosen for ``model``; ``captures``, when given,
        receives the search's captures (``(micro-batches, remat, regather) -> Capture``)
        for the caller to reuse."""
        ...

    def check_plan_kind(self, plan: object) -> None:
        """TypeError unless ``plan`` is a plan of a method it chooses among."""
        ...

    def concrete(self, method: AutoParallel) -> ShardParallel:
        """The concrete method for work it does not search over (generation, programs:
        one mesh, intra-op), with its sharding options."""
        ...


class GenerationSteps(Protocol):
    """A method that plans and places generation's forward-only steps."""

    def for_generation(self, method) -> ShardParallel:
        """``method`` as generation plans it, or a ValueError saying why not."""
        ...

    def target(self, method, *, cluster: Cluster | LogicalMesh | None,
               mesh: DeviceMesh | None, world: int, live: bool) -> object:
        ...

    def with_options(self, method, *, mesh: DeviceMesh | None = None,
                     init_weights: Callable | None = None) -> ShardParallel:
        ...

    def solve(self, graph: OpGraph, target, method, inputs: str) -> Plan:
        """The decode step's plan."""
        ...

    def solve_pinned(self, graph: OpGraph, plan: Plan, target, method, inputs: str) -> Plan:
        """Plan the forward-only ``graph`` on ``plan``'s mesh with every parameter and
        buffer held to its layout in ``plan`` (rank 0 plans: call it on every rank)."""
        ...

    def check_plan_kind(self, plan: object) -> None:
        ...

    def check_given_plan(self, plan, graph: OpGraph, target) -> None:
        ...

    def place_forward(self, plan: Plan, target, method,
                      device: torch.device) -> PlacedForward:
        """This rank's mesh and the lowering of forward-only programs of ``plan``."""
        ...


class ProgramSteps(Protocol):
    """A method that plans a JAX function or StableHLO program whole."""

    def plan_program(self, program: object, example_inputs: Sequence, *, method,
                     cluster: Cluster | LogicalMesh | None, inputs: str,
                     param_argnums: int | Sequence[int], num_params: int | None) -> Plan:
        """The plan of the program."""
        ...
