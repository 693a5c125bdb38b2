"""The records of one rank's programs: as lowered (``StageProgram``) and as a step runs them
(``StepPrograms``).

The lowering (``runtime.lowering.lower``) makes a ``StageProgram``: the forward, backward and
gradient-reduction programs of the rank's stage, with the wiring to the other stages. Those
are the programs ``local_program()`` prints, the profiler times and a rematerialized stage
runs again. The last group of rewrites (``runtime.rewrites.program_rewrites.step_programs``) derives from
them the programs a ``StepRunner`` calls -- a forward that leaves the loss's all-reduce in
flight, a backward that issues the gradients' collectives as it goes, copies with less
Python per op -- and hands them over as a ``StepPrograms``: one forward/backward pair
(``ProgramPair``) per ``StepMode``, the way the step's caller reads the loss. The runner
runs the pair its step's mode picks; it builds nothing and chooses no variant.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx

from torchalpa.runtime.rewrites.buckets import LossInBucket
from torchalpa.runtime.rewrites.grad_sums import add_into_sums
from torchalpa.runtime.rewrites.release_inputs import TAKES_LIST, call_releasing, release_inputs

__all__ = ["StageProgram", "StepPrograms", "StepMode", "ProgramPair", "SummedBackward",
           "summed_backward",
           "ReducingBackward", "LossInBucketBackward", "already_reduced", "EagerOrTraced",
           "LossInBucketPrograms", "ValueKey", "PLAN_STEP"]

PLAN_STEP = "torchalpa_plan_step"
"""``node.meta`` key of a collective call: (consumer, slot, index) of its plan step."""

ValueKey = tuple[str, int]
"""Output ``index`` of source node ``producer``: a value that may cross stages."""


@dataclass
class StageProgram:
    """One rank's programs and how they are wired to the other stages of a pipeline (an
    intra-op plan's are a stage that receives and sends nothing).

    ``forward(*params, *buffers, *user inputs, *forward_recvs)`` -> (loss if ``has_loss``,
    *forward sends, *buffer updates, *saved); ``backward(*saved, *backward_recvs)`` -> (one
    raw gradient per parameter of ``params`` or None, *backward sends); ``reduce_grads(*raw
    gradients that are not None)`` -> those gradients in their parameters' layouts.
    """

    forward: fx.GraphModule
    backward: fx.GraphModule
    reduce_grads: fx.GraphModule
    buffer_updates: tuple = ()    # buffers whose new values forward returns, in order
    params: list[str] = field(default_factory=list)    # FQNs of this stage's trainable params
    buffers: list[str] = field(default_factory=list)   # FQNs of its buffers / frozen params
    user_inputs: list[int] = field(default_factory=list)   # the user inputs this stage reads
    forward_recvs: list[ValueKey] = field(default_factory=list)   # received before forward
    backward_recvs: list[ValueKey] = field(default_factory=list)  # received before backward
    forward_sends: list[ValueKey] = field(default_factory=list)
    backward_sends: list[ValueKey] = field(default_factory=list)
    has_loss: bool = False
    grad_present: list[bool] = field(default_factory=list)
    # gradient parts received once per step, summed over the micro-batches by their
    # sender: (key, index among the present gradients, program laying the sum out as
    # that gradient's addend)
    summed_recvs: list[tuple[ValueKey, int, fx.GraphModule]] = field(default_factory=list)
    # gradient parts sent once per step: key -> program making their sum over the
    # micro-batches whole (the send's plan steps, run once, after the last backward)
    summed_sends: dict[ValueKey, fx.GraphModule] = field(default_factory=dict)
    # (*params, *buffers) -> the parameters' gathered copies forward takes after its other
    # inputs, run once per step before the first micro-batch (``runtime.rewrites.param_gather``)
    param_gathers: fx.GraphModule | None = None
    compiled_from: StageProgram | None = field(default=None, repr=False)
    """The eager programs these were compiled from (``compiled``), else None."""

    @property
    def num_results(self) -> int:
        """How many of forward's outputs come before the values saved for backward (the
        loss, the sends and the buffer updates)."""
        return int(self.has_loss) + len(self.forward_sends) + len(self.buffer_updates)

    def code(self) -> str:
        if self.compiled_from is not None:
            return "# compiled with torch.compile from:\n" + self.compiled_from.code()
        gathers = self.param_gathers
        once = "" if gathers is None else ("# param_gathers, once per step: (params, buffers) -> "
                                           "gathered copies\n" + gathers.code + "\n")
        return (once + "# forward: (params, buffers, inputs) -> (loss, saved...)\n" + self.forward.code
                + "\n# backward: (saved...) -> raw grads\n" + self.backward.code
                + "\n# reduce_grads: (raw grads...) -> grads in their parameters' layouts\n"
                + self.reduce_grads.code)

    def compiled(self, **options) -> StageProgram:
        """The same programs under ``torch.compile(**options)`` (compiled on first call),
        with the same wiring; ``code()`` prints the source programs. A stage's
        ``summed_recvs`` addends and ``param_gathers`` run once per step and stay eager."""
        return replace(self,
                       forward=torch.compile(self.forward, **options),  # pyright: ignore
                       backward=torch.compile(self.backward, **options),  # pyright: ignore
                       reduce_grads=torch.compile(self.reduce_grads, **options),  # pyright: ignore
                       compiled_from=self)


@dataclass(frozen=True)
class EagerOrTraced:
    """A program and its copy for eager runs (``runtime.rewrites.call_overhead``): called while
    ``torch.compile`` traces the step, the program as lowered runs (dynamo traces its ATen
    calls), else the copy, whose calls skip Python's per-op dispatch."""

    traced: Callable
    eager: Callable

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.traced(*args)
        return self.eager(list(args)) if getattr(self.eager, TAKES_LIST, False) \
            else self.eager(*args)

    def call_list(self, inputs: list):
        """The program on the list ``inputs``, emptied (``release_inputs.call_releasing``):
        an eager copy that takes a list frees each input after its last read."""
        if not torch.compiler.is_compiling() and getattr(self.eager, TAKES_LIST, False):
            return self.eager(inputs)
        return call_releasing(self.traced if torch.compiler.is_compiling() else self.eager,
                              inputs)


@dataclass(frozen=True)
class LossInBucketPrograms:
    """The programs of a ``train_step`` whose loss all-reduce travels inside a gradient
    bucket's (``runtime.rewrites.loss_in_bucket``).

    ``forward``: as the source forward, its loss output replaced by a tuple (the loss's
    local part first, then the other values its tail reads); ``backward_reduce``: backward
    and the gradients' collectives (``runtime.rewrites.reduce_in_backward``), taking that local part
    after its own inputs and returning it reduced after the gradients; ``finish(reduced,
    others)``: the loss. ``plan_step``: (consumer, slot, index) of the loss's collective in
    the plan; ``bucket``: the bucket it travels in; ``listed``: where the plan lists the
    two (``runtime.rewrites.program_rewrites.step_programs`` fills it, or gives these programs up)."""

    forward: fx.GraphModule
    backward_reduce: fx.GraphModule
    finish: Callable[[torch.Tensor, tuple], torch.Tensor]
    plan_step: tuple
    bucket: int
    listed: LossInBucket | None = None


class StepMode(enum.Enum):
    """How the caller of a step reads it, which picks the step's forward/backward pair
    (``StepPrograms.pair``)."""

    FORWARD_ONLY = "forward only"
    """``torch.no_grad()``: the loss, nothing kept for a backward (the ``LOSS_FIRST`` forward)."""
    LOSS_FIRST = "loss before backward"
    """``loss = pm(x); loss.backward()``: the loss is returned before backward runs, so its
    all-reduce is its own, left in flight until the loss is read."""
    LOSS_LAST = "loss after backward"
    """``train_step``: the loss is read after backward, so its all-reduce may travel inside
    a gradient bucket (``runtime.rewrites.loss_in_bucket``) where the programs allow."""

    @property
    def keeps_saved(self) -> bool:
        """Whether forward keeps what backward reads."""
        return self is not StepMode.FORWARD_ONLY


@dataclass(frozen=True)
class ProgramPair:
    """The forward and backward a step runs in one ``StepMode``, one calling convention for
    every variant (``runtime.rewrites.program_rewrites.step_programs`` builds them):

    ``forward(*params, *buffers, *user inputs, *forward_recvs, *gathered params)`` ->
    (loss part if the stage has the loss, *forward sends, *buffer updates, *saved);
    ``backward(saved, received, loss part or None)`` (``saved`` a list, which it empties:
    each saved value is freed after its last read) -> (gradients, one per parameter or
    None, summed over micro-batches; backward sends; the loss part, maybe changed);
    ``reduce_grads(*summed gradients that are not None)`` -> them in their parameters'
    layouts; ``finish_loss(loss part)`` -> the loss (None: the part is the loss, or a
    loss that travels through backward, which backward finishes). ``loss_in_bucket``:
    where the plan lists the loss sent inside a gradient bucket, for the pair that sends it
    so (None: the loss has its own all-reduce)."""

    forward: Callable
    backward: Callable[[list, Sequence, Any], tuple[Sequence, Sequence, Any]]
    reduce_grads: Callable
    finish_loss: Callable | None = None
    loss_in_bucket: LossInBucket | None = None


@dataclass(frozen=True)
class SummedBackward:
    """A backward whose raw gradients are summed over micro-batches and reduced once per
    step (``reduce_grads``); sends to the stages before, if any. ``starting`` and
    ``summing``: the program copying each gradient into a sum of the step's own as it
    makes it (the first micro-batch's, ``start``) and adding each into the sums
    (``add_into``; ``runtime.rewrites.grad_sums``), so the micro-batch's gradients are
    never all alive beside the sums; None (a program ``torch.compile`` made): summed
    after it returns."""

    program: Callable       # (*saved, *received) -> (*raw gradients, *sends)
    num_grads: int
    summing: Callable | None = None     # (*saved, *received, *sums) -> (*sums, *sends)
    starting: Callable | None = None    # (*saved, *received) -> (*new sums, *sends)

    def __call__(self, saved: list, received: Sequence, loss: Any):
        inputs = [*saved, *received]
        saved.clear()
        out = call_releasing(self.program, inputs)
        return out[:self.num_grads], out[self.num_grads:], loss

    def start(self, saved: list, received: Sequence, loss: Any):
        """The first micro-batch's backward: (the new sums, one per gradient or None,
        sends, loss)."""
        assert self.starting is not None
        inputs = [*saved, *received]
        saved.clear()
        out = call_releasing(self.starting, inputs)
        return out[:self.num_grads], out[self.num_grads:], loss

    def add_into(self, saved: list, received: Sequence, loss: Any, sums: list):
        """Backward adding its gradients into ``sums`` (one per gradient that is not None,
        made by ``start``) in place: (sends, loss)."""
        assert self.summing is not None
        inputs = [*saved, *received, *sums]
        saved.clear()
        out = call_releasing(self.summing, inputs)
        return out[self.num_grads:], loss


def summed_backward(program: Callable, num_grads: int, eager=None) -> SummedBackward:
    """``SummedBackward`` of ``program``, with its summing copies where it is an FX program.
    ``eager``: makes the copies a step runs eagerly (an FX program -> a program, e.g.
    ``release_inputs``, which frees each saved value at its last read), given a copy of
    its own; None: the programs run as they are."""
    if not isinstance(program, fx.GraphModule):
        return SummedBackward(program, num_grads)

    def variant(start: bool) -> Callable:
        traced = add_into_sums(program, num_grads, start)
        return traced if eager is None else \
            EagerOrTraced(traced, eager(add_into_sums(program, num_grads, start)))
    plain = program if eager is None else EagerOrTraced(
        program, eager(fx.GraphModule(program, copy.deepcopy(program.graph))))
    return SummedBackward(plain, num_grads, variant(False), variant(True))


@dataclass(frozen=True)
class ReducingBackward:
    """Backward and the gradients' collectives as one program (one micro-batch, one
    stage: ``runtime.rewrites.reduce_in_backward``); its gradients need no more reduction."""

    program: Callable       # (*saved) -> gradients in their layouts

    def __call__(self, saved: list, received: Sequence, loss: Any):
        return call_releasing(self.program, saved), (), loss


@dataclass(frozen=True)
class LossInBucketBackward:
    """``ReducingBackward`` that also all-reduces the loss's local part in a gradient bucket
    and finishes the loss (``LossInBucketPrograms``)."""

    program: Callable       # (*saved, local part) -> (*gradients, reduced part)
    finish: Callable[[torch.Tensor, tuple], torch.Tensor]

    def __call__(self, saved: list, received: Sequence, loss: Any):
        local, others = loss
        saved.append(local)
        *grads, reduced = call_releasing(self.program, saved)
        return grads, (), self.finish(reduced, others)


def already_reduced(*grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``reduce_grads`` of a pair whose backward reduced the gradients itself."""
    return grads


@dataclass
class StepPrograms:
    """What a ``StepRunner`` calls for one rank's stage (``runtime.rewrites.program_rewrites.step_programs``
    makes it; the runner derives nothing and chooses no variant).

    ``loss_first``, ``loss_last``: the forward/backward pairs of ``StepMode.LOSS_FIRST``
    and ``LOSS_LAST`` (``pair(mode)`` picks one; the same pair where the two do not
    differ). ``param_gathers``: as ``StageProgram``'s. ``stage``: the programs as lowered,
    and the wiring (what a rematerialized stage replays, what ``local_program()`` prints)."""

    stage: StageProgram
    loss_first: ProgramPair
    loss_last: ProgramPair
    param_gathers: Callable | None = None

    def pair(self, mode: StepMode) -> ProgramPair:
        """The pair a step of ``mode`` runs. Traced by ``torch.compile``, ``LOSS_LAST``
        runs ``loss_first``'s (the loss-in-bucket programs are eager copies)."""
        if mode is StepMode.LOSS_LAST and not torch.compiler.is_compiling():
            return self.loss_last
        return self.loss_first

    @classmethod
    def as_lowered(cls, stage: StageProgram) -> StepPrograms:
        """The stage's programs run as they are, in every mode (a stage of a longer
        pipeline, or programs compiled by ``torch.compile``, which the variants' FX
        rewrites cannot read)."""
        reduce_grads = stage.reduce_grads
        if isinstance(reduce_grads, fx.GraphModule):    # frees each sum once packed
            reduce_grads = EagerOrTraced(reduce_grads, release_inputs(
                fx.GraphModule(reduce_grads, copy.deepcopy(reduce_grads.graph))))
        plain = ProgramPair(stage.forward, summed_backward(stage.backward, len(stage.grad_present),
                                                           release_inputs), reduce_grads)
        return cls(stage, plain, plain, stage.param_gathers)

    def compiled(self, **options) -> StepPrograms:
        """The stage's programs under ``torch.compile(**options)``, run as they are."""
        return StepPrograms.as_lowered(self.stage.compiled(**options))
