"""What the one orchestration (``torchalpa.parallel.build``) asks of a parallel method.

A method class (``ShardParallel``, ``PipeshardParallel``...) is plain data; its
``MethodSteps`` say how it plans and places a step: which meshes or submeshes are
candidates (``target``), how one captured step is solved (``solve``), and how a plan
becomes this rank's program and state (``place``). ``torchalpa.parallel.methods`` maps
each method class to its steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["MethodSteps", "Placed", "PlacedForward"]


@dataclass
class Placed:
    """This rank's part of a plan, ready to run: what ``MethodSteps.place`` returns."""

    program: Any
    """The programs a step runs (``runtime.lowering.rank_programs.StepPrograms``; ``compiled()`` gives
    them under ``torch.compile``)."""
    mesh: Any
    """This rank's DeviceMesh (its stage's, in a pipeline)."""
    distribute: Callable[[Callable | None], None]
    """Swap the model's parameters and buffers for this rank's DTensor shards
    (``init_weights`` given: initialize a meta model's blocks with it)."""
    num_micro_batches: int
    stage: int = 0
    runner_options: dict = field(default_factory=dict)
    """Keywords of ``StepRunner`` beyond the program and the micro-batch count."""
    forward_programs: Any = None
    """Forward-only programs (predict, eval), or None where the method has none."""
    description: str = ""
    """One line for the log: what this rank runs."""


@dataclass
class PlacedForward:
    """Where forward-only programs of a plan run (generation's prefill and decode steps):
    what ``MethodSteps.place_forward`` returns."""

    mesh: Any
    """This rank's DeviceMesh."""
    lower: Callable[[Any, Any, list[str]], Any]
    """``lower(gm, plan, buffer_updates)``: a captured forward step (``capture_forward``)
    as this rank's program ``(*state blocks, *inputs) -> (result, *new buffer blocks)``."""


class MethodSteps(Protocol):
    """The method-specific steps of planning and building; see the module docstring.

    A method that chooses among the others (``AutoParallel``) sets ``chooses_method``
    and implements ``search``; the orchestration then goes on with the concrete method of
    the plan found (``torchalpa.core.options.method_of_plan``) and its steps."""

    chooses_method: bool

    def with_options(self, method, *, inputs: str = "global", signature=None, mesh=None,
                     num_micro_batches: int | None = None, init_weights=None) -> Any:
        """``method`` with ``auto_parallel``'s options applied, or a ValueError naming an
        option the method cannot honour and what to do instead."""
        ...

    def target(self, method, *, cluster, mesh, world: int, live: bool) -> Any:
        """What the method plans for: candidate logical meshes, or a cluster to cut into
        submeshes. ``live``: under ``auto_parallel``, every rank of the job is here (the
        mesh must fit the world; with no cluster given, the live process group may be
        calibrated, which is collective); False: planning without processes."""
        ...

    def solve(self, graph, target, method, inputs: str, measured: Any = None) -> Any:
        """The plan of one captured step (cached where the method caches)."""
        ...

    def plan_program(self, program, example_inputs, *, method, cluster, inputs: str,
                     param_argnums, num_params) -> Any:
        """The plan of a JAX function or StableHLO program, or a ValueError saying why
        the method does not plan programs."""
        ...

    def measure(self, captured, target, method, example_inputs, model, device) -> Any:
        """Measurements the solve needs from this job's devices (collective), or None."""
        ...

    def check_plan_kind(self, plan) -> None:
        """TypeError/ValueError unless ``plan`` is a plan of this method's kind."""
        ...

    def check_given_plan(self, plan, graph, target) -> None:
        """A ``plan=`` is checked like a cached one: step, mesh, shapes and layouts."""
        ...

    def search(self, model, example_inputs, loss_fn, *, method, target, inputs: str,
               signature=None, captures: dict | None = None) -> Any:
        """The plan of the concrete method chosen for ``model`` (only where
        ``chooses_method``); ``captures``, when given, receives the search's captures
        (``(micro-batches, remat, regather) -> Capture``) for the caller to reuse."""
        ...

    def inference_method(self, method) -> Any:
        """The method that plans generation's forward steps (``mode="inference"``), or a
        ValueError saying which method to use instead."""
        ...

    def solve_pinned(self, graph, plan, target, method, inputs: str) -> Any:
        """Plan the forward-only ``graph`` on ``plan``'s mesh with every parameter and
        buffer held to its layout in ``plan`` (rank 0 plans: call it on every rank)."""
        ...

    def place_forward(self, plan, target, method, device) -> PlacedForward:
        """This rank's mesh and the lowering of forward-only programs of ``plan``."""
        ...

    def place(self, captured, plan, target, method, device, *, model, traced, loss_fn,
              inputs: str, signature) -> Placed:
        """This rank's mesh, lowered program and state placement. ``model``: the user's
        module (whose state is distributed); ``traced``: what was captured (the model, or
        it computing in a narrower dtype)."""
        ...
