"""Run one rank's programs for a step: the micro-batches through a pipeline schedule.

An intra-op plan is the one-stage case of a pipeline: its programs are a stage that
receives and sends nothing, and its step is that stage's part of the schedule. So one
runner serves both:

- the global batch is split along dim 0 into ``k`` micro-batches, once (the plan was made
  for one);
- with ``k > 1``, the parameters' gathered copies forward reads are made once, before the
  first micro-batch (``program.param_gathers``, ``runtime.param_gather``), and every
  micro-batch's forward reads them; the runner drops them after the last forward (what
  backward reads, each micro-batch's saved values hold);
- the schedule's actions run in order: ``("F", m)`` the forward program on micro-batch
  ``m`` (receiving and sending activations when other stages exist), ``("B", m)`` its
  backward, summing the raw gradients locally;
- the plan's final resharding of the gradients (``reduce_grads``) runs once for the step,
  then the ``1/k`` factor: the loss is the mean of the micro-batch losses and the gradients
  are those of that mean, so for a loss that averages over the batch (the usual
  ``reduction="mean"``) both equal what one device computes on the whole batch.

A one-stage step can stop after its forward actions and run its backward actions later
(behind ``loss.backward()``); a stage of a longer pipeline interleaves them with the
other stages' (1F1B cannot wait), so its module runs the whole step at once. With one
micro-batch and one stage, backward and the gradients' collectives run as one program,
each collective issued as soon as its gradients exist (``runtime.early_reduce``); then
``train_step``, which reads the loss after backward, sends the loss's all-reduce inside a
gradient bucket's (``runtime.loss_ride``), where the plan's collectives allow it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
import torch.fx as fx

from torchalpa.core.schedules import SCHEDULES, Action
from torchalpa.runtime.deferred_loss import defer_loss_wait
from torchalpa.runtime.early_reduce import early_reduce_program
from torchalpa.runtime.loss_ride import RiddenPrograms, ride_loss_on_bucket
from torchalpa.runtime.lower import StageProgram, ValueKey
from torchalpa.runtime.stage_recompute import Replay, random_state, replaying
from torchalpa.runtime.streamline import streamlined_copy

__all__ = ["StepRunner", "StepInFlight", "Exchange", "split_micro_batches"]


def split_micro_batches(inputs: Sequence[torch.Tensor], num_micro_batches: int,
                        what: str = "input") -> list[list[torch.Tensor]]:
    """``k`` lists of inputs, each holding chunk ``i`` of every input's dim 0."""
    if num_micro_batches == 1:
        return [list(inputs)]
    for i, x in enumerate(inputs):
        if x.dim() == 0 or x.shape[0] % num_micro_batches:
            size = "no dim 0" if x.dim() == 0 else f"dim 0 of size {x.shape[0]}"
            raise ValueError(f"{what} {i} has {size}, which does not split into "
                             f"num_micro_batches={num_micro_batches} equal micro-batches; use "
                             "a batch size that divides, or another num_micro_batches")
    chunks = [torch.chunk(x, num_micro_batches, dim=0) for x in inputs]
    return [[c[m] for c in chunks] for m in range(num_micro_batches)]


class Exchange(Protocol):
    """How a stage trades values with the other stages (``runtime.pipeline.StageExchange``)."""

    def begin(self) -> None: ...
    def send(self, key: ValueKey, value: torch.Tensor, micro: int) -> None: ...
    def recv(self, key: ValueKey, micro: int) -> torch.Tensor: ...
    def finish(self, program: StageProgram, raw: list, backward: bool) -> None: ...


@dataclass
class StepInFlight:
    """One step between its forward and backward actions: the micro-batches, what each
    forward saved for its backward, the losses, the new buffer values (of the last
    micro-batch) and the raw gradients so far.

    All of a step's state lives here, never on the runner, so a step is created and
    changed by the code that runs it: under ``torch.compile`` an autograd.Function's
    forward and backward are traced as separate scopes, neither of which may mutate an
    object the other made (``StepRunner.resume`` gives the backward its own step)."""

    micro_inputs: list[list[torch.Tensor]]
    saved: dict[int, list] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    buffer_updates: list[torch.Tensor] = field(default_factory=list)
    raw: list[torch.Tensor | None] = field(default_factory=list)   # one per present gradient
    reduced: list[torch.Tensor | None] | None = None     # set when backward also reduced
    losses_waited: bool = False      # the losses' all-reduce, left in flight, is finished
    finish_loss: Callable | None = None   # waits for that all-reduce (None: forward waited)
    rides: bool = False              # the loss's all-reduce rides a gradient bucket
    gathered: list[torch.Tensor] | None = None   # the parameters' copies made once per step


class StepRunner:
    """Forward, backward and gradient reduction of one rank's stage, micro-batch by
    micro-batch, in the order a schedule gives (one stage: the intra-op step)."""

    def __init__(self, program: StageProgram, num_micro_batches: int = 1, *,
                 schedule: str = "1f1b", num_stages: int = 1, stage: int = 0,
                 exchange: Exchange | None = None, recompute: bool = False):
        if (num_stages > 1) != (exchange is not None):
            raise ValueError("a stage of a multi-stage pipeline needs an exchange, and a "
                             "one-stage step has nobody to exchange with")
        if recompute and exchange is None:
            raise ValueError("recompute=True checkpoints a stage of a multi-stage pipeline; "
                             "a one-stage step checkpoints its layers with remat='full'")
        # keep only each micro-batch's inputs and run its forward again before its backward
        # (runtime/stage_recompute.py)
        self.recompute = recompute
        self.program = program
        self.num_micro_batches = num_micro_batches
        self.exchange = exchange
        self.actions: list[Action] = SCHEDULES[schedule](num_stages, num_micro_batches)[stage]
        # (traced by torch.compile, plain; run eagerly, streamlined: ``runtime.streamline``)
        self._backward_reduce = None if exchange is not None else early_reduce_program(
            program.backward, program.reduce_grads, num_micro_batches)
        self._backward_reduce_eager = None if self._backward_reduce is None else \
            streamlined_copy(self._backward_reduce)
        self._deferred: tuple = (None,) * 4  # (program.forward, its copy, streamlined, wait)
        # train_step's programs with the loss riding a bucket, and their streamlined copies
        self._ride: RiddenPrograms | None = None if self._backward_reduce is None \
            or not program.has_loss else ride_loss_on_bucket(program.forward,
                                                             self._backward_reduce)
        self._ride_source = program.forward
        self._ride_eager: tuple = () if self._ride is None else (
            streamlined_copy(self._ride.forward, self._saved_from()),
            streamlined_copy(self._ride.backward_reduce))
        self._forward()        # built now: building a program inside torch.compile's trace
                               # would break its graph

    @property
    def defers_backward(self) -> bool:
        """Whether the step's backward actions can wait for ``loss.backward()``: one stage."""
        return self.exchange is None

    @property
    def loss_ride(self) -> tuple[tuple, int] | None:
        """When ``run(..., ride_loss=True)`` sends the loss inside a bucket: the plan step
        ((consumer, slot, index)) of the loss's all-reduce and the bucket's index."""
        return None if self._ride is None else (self._ride.plan_step, self._ride.bucket)

    def forgo_loss_ride(self) -> None:
        """Keep the loss's own all-reduce in every step (the plan cannot list the ride)."""
        self._ride, self._ride_eager = None, ()

    def _rides(self) -> bool:
        """Whether a step asking for it can send its loss inside a bucket now: the ride's
        programs were derived from the current forward, and nothing is being traced."""
        return self._ride is not None and self.program.forward is self._ride_source \
            and not torch.compiler.is_compiling()

    def _saved_from(self) -> int:
        """The forward's first output that backward reads (after the loss, the sends and
        the buffer updates)."""
        p = self.program
        return int(p.has_loss) + len(p.forward_sends) + len(p.buffer_updates)

    def forward_actions(self) -> list[Action]:
        return [("F", m) for m in range(self.num_micro_batches)]

    def backward_actions(self) -> list[Action]:
        return [("B", m) for m in range(self.num_micro_batches)]

    def begin(self, inputs: Sequence[torch.Tensor]) -> StepInFlight:
        """A step on the global batch ``inputs``, split into micro-batches (the one split)."""
        present = sum(self.program.grad_present)
        return StepInFlight(split_micro_batches(inputs, self.num_micro_batches),
                            raw=[None] * present)

    def resume(self, saved: Sequence[Sequence[torch.Tensor]]) -> StepInFlight:
        """A new step holding only what each micro-batch's forward saved (``saved[m]``),
        ready for the backward actions: what a deferred backward runs on, built from
        the tensors the forward handed over instead of the forward's own step."""
        present = sum(self.program.grad_present)
        return StepInFlight([], saved={m: list(s) for m, s in enumerate(saved)},
                            raw=[None] * present)

    def run(self, step: StepInFlight, state: list[torch.Tensor], actions: list[Action], *,
            keep_saved: bool = True, ride_loss: bool = False) -> None:
        """Execute ``actions`` of ``step``; ``keep_saved=False``: forward only, nothing
        kept for backward. ``ride_loss``: the loss is read only after these actions, which
        run the backward too: send it inside a gradient bucket where the programs allow
        (``step.rides`` tells)."""
        p, exchange = self.program, self.exchange
        if exchange is not None:
            exchange.begin()
        step.rides = ride_loss and keep_saved and self._rides() \
            and any(kind == "B" for kind, _ in actions)
        for kind, m in actions:
            if kind == "F":
                received = [exchange.recv(k, m) for k in p.forward_recvs] if exchange else []
                if step.rides:
                    forward, step.finish_loss = self._ride_eager[0], None
                else:
                    forward, step.finish_loss = self._forward()
                rng = random_state(_device_of(state, received)) if self.recompute else None
                out = list(forward(*state, *[step.micro_inputs[m][i] for i in p.user_inputs],
                                   *received, *self._gathered(step, state, m)))
                if p.has_loss:
                    step.losses.append(out.pop(0))
                for k in p.forward_sends:
                    assert exchange is not None
                    exchange.send(k, out.pop(0), m)
                n = len(p.buffer_updates)
                if n:
                    step.buffer_updates, out = out[:n], out[n:]
                if keep_saved:
                    step.saved[m] = out if rng is None else [Replay(m, received, rng)]
                del out
            else:
                self._backward(step, m, state)
        if exchange is not None:
            exchange.finish(p, step.raw, any(kind == "B" for kind, _ in actions))

    def _gathered(self, step: StepInFlight, state: list[torch.Tensor], m: int
                  ) -> list[torch.Tensor]:
        """The gathered parameters micro-batch ``m``'s forward reads: made at the step's
        first forward, released from the step at its last (saved values keep what backward
        reads)."""
        gathers = self.program.param_gathers
        if gathers is None:
            return []
        if step.gathered is None:
            step.gathered = list(gathers(*state))
        gathered = step.gathered
        if m == self.num_micro_batches - 1:
            step.gathered = None
        return gathered

    def _forward(self) -> tuple[Callable, Callable | None]:
        """The forward program to run and what waits for its loss: one stage's leaves the
        loss's all-reduce in flight (``runtime.deferred_loss``) and ``loss()`` waits for it;
        run eagerly, a streamlined copy (``runtime.streamline``). Derived from the program's
        current ``forward`` (and again if that is replaced, except while torch.compile
        traces: then the replacement runs as it is)."""
        source = self.program.forward
        if self._deferred[0] is not source:
            if torch.compiler.is_compiling():
                return source, None
            deferred = defer_loss_wait(source) if self.exchange is None and \
                self.program.has_loss else None
            traced, wait = deferred if deferred is not None else (source, None)
            eager = streamlined_copy(traced, self._saved_from()) \
                if isinstance(traced, fx.GraphModule) and self.exchange is None else traced
            self._deferred = (source, traced, eager, wait)
        program = self._deferred[1] if torch.compiler.is_compiling() else self._deferred[2]
        return program, self._deferred[3]

    def _replay(self, step: StepInFlight, state: list[torch.Tensor], replay: Replay) -> list:
        """What micro-batch ``replay.micro``'s forward saved, by running that forward again
        on its inputs from its random state (its loss, sends and buffer updates were
        delivered by the first run and are dropped)."""
        p = self.program
        with replaying(replay.rng, _device_of(state, replay.received)):
            out = list(p.forward(*state, *[step.micro_inputs[replay.micro][i]
                                            for i in p.user_inputs], *replay.received))
        return out[self._saved_from():]

    def _backward(self, step: StepInFlight, m: int, state: list[torch.Tensor]) -> None:
        p, exchange = self.program, self.exchange
        saved = step.saved.pop(m)
        if saved and isinstance(saved[0], Replay):
            saved = self._replay(step, state, saved[0])
        if step.rides:             # one micro-batch, one stage; the loss in a bucket
            assert self._ride is not None and len(step.losses) == 1
            local, others = cast(tuple, step.losses[0])     # (local part, tail's values)
            *step.reduced, reduced_loss = self._ride_eager[1](*saved, local)
            step.losses = [self._ride.finish(reduced_loss, others)]
            step.losses_waited = True
            return
        if self._backward_reduce is not None:       # one micro-batch, one stage
            program = self._backward_reduce if torch.compiler.is_compiling() \
                else self._backward_reduce_eager
            assert program is not None
            step.reduced = list(program(*saved))
            return
        received = [exchange.recv(k, m) for k in p.backward_recvs] if exchange else []
        out = list(p.backward(*saved, *received))
        del saved
        n = len(p.grad_present)      # one raw gradient per parameter, None: unused
        for i, g in enumerate(g for g in out[:n] if g is not None):
            # out of place: a raw gradient may alias a value the caller still holds
            step.raw[i] = g if step.raw[i] is None else step.raw[i] + g
        for k, v in zip(p.backward_sends, out[n:]):
            assert exchange is not None
            exchange.send(k, v, m)

    def loss(self, step: StepInFlight) -> torch.Tensor | None:
        """The mean of the step's micro-batch losses (None: this stage computes none).
        Waits for the losses' all-reduce, which forward left in flight: call it as late as
        the loss is needed (after backward, in ``train_step``) to overlap the two."""
        if not step.losses:
            return None
        assert not step.rides or step.losses_waited, \
            "a loss riding a gradient bucket is read after the step's backward"
        finish = step.finish_loss
        if finish is not None and not step.losses_waited:
            step.losses = [finish(x) for x in step.losses]
            step.losses_waited = True
        return step.losses[0] if len(step.losses) == 1 else torch.stack(step.losses).mean()

    def gradients(self, step: StepInFlight, scale: torch.Tensor | float | None = None
                  ) -> list[torch.Tensor | None]:
        """Gradients of ``scale * mean loss`` in their parameters' layouts, one per
        parameter of the stage (None: unused): the plan's resharding runs once here."""
        if step.reduced is not None:
            grads = step.reduced
        else:
            reduced = iter(self.program.reduce_grads(*step.raw))
            grads = [next(reduced) if present else None for present in self.program.grad_present]
        factor = 1.0 / self.num_micro_batches
        out = []
        for g in grads:
            if g is not None:
                if scale is not None:
                    g = g * scale
                if factor != 1.0:
                    g = g * factor
            out.append(g)
        return out


def _device_of(*groups: Sequence[torch.Tensor]) -> torch.device | None:
    """The device of the first tensor in ``groups`` (whose random state a replay keeps)."""
    for group in groups:
        for t in group:
            if isinstance(t, torch.Tensor):
                return t.device
    return None
