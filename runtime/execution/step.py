"""Run one rank's programs for a step: the micro-batches through a pipeline schedule.

An intra-op plan is the one-stage case of a pipeline: its programs are a stage that
receives and sends nothing, and its step is that stage's part of the schedule. So one
runner serves both. It runs the programs of a ``rank_programs.StepPrograms`` and derives
none: a step begins in a ``StepMode`` (how its caller reads the loss), which picks one
forward/backward pair (``ProgramPair``), and every action of the step calls that pair's
programs the same way. Which variant each pair holds (a forward that leaves the loss's
all-reduce in flight, a backward that reduces the gradients as it goes, the loss inside a
gradient bucket, a copy with less Python per op) was decided by the lowering's rewrites
(``runtime.rewrites.program_rewrites.step_programs``).

- the global batch is split along dim 0 into ``k`` micro-batches, once (the plan was made
  for one);
- with ``k > 1``, the parameters' gathered copies forward reads are made once, before the
  first micro-batch (``programs.param_gathers``, ``runtime.rewrites.param_gather``), and every
  micro-batch's forward reads them; the runner drops them after the last forward (what
  backward reads, each micro-batch's saved values hold);
- the schedule's actions run in order: ``("F", m)`` the forward program on micro-batch
  ``m`` (receiving and sending activations when other stages exist), ``("B", m)`` its
  backward, summing the gradients locally;
- the pair's final resharding of the gradients (``reduce_grads``) runs once for the step,
  then the ``1/k`` factor: the loss is the mean of the micro-batch losses and the gradients
  are those of that mean, so for a loss that averages over the batch (the usual
  ``reduction="mean"``) both equal what one device computes on the whole batch.

A one-stage step can stop after its forward actions and run its backward actions later
(behind ``loss.backward()``); a stage of a longer pipeline interleaves them with the
other stages' (1F1B cannot wait), so its module runs the whole step at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from torchalpa.core.schedules import SCHEDULES, Action
from torchalpa.runtime.execution.stage_replay import Replay, random_state, replaying
from torchalpa.runtime.lowering.rank_programs import (
    ProgramPair,
    StageProgram,
    StepMode,
    StepPrograms,
    ValueKey,
)
from torchalpa.runtime.rewrites.release_inputs import call_releasing

__all__ = ["StepRunner", "StepInFlight", "StepLoss", "StepMode", "Exchange",
           "split_micro_batches"]


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
    """How a stage trades values with the other stages (``runtime.execution.pipeline.StageExchange``)."""

    def begin(self) -> None: ...
    def send(self, key: ValueKey, value: torch.Tensor, micro: int) -> None: ...
    def recv(self, key: ValueKey, micro: int) -> torch.Tensor: ...
    def finish(self, program: StageProgram, raw: list, backward: bool) -> None: ...


@dataclass
class StepLoss:
    """A step's micro-batch losses, as its forwards left them.

    ``parts``: one per micro-batch, the loss or what ``finish`` makes it from (a forward
    that left the loss's all-reduce in flight returns the collective's handle; one whose
    loss travels in a gradient bucket, its local part, which the backward finishes).
    ``finish``: the step's pair's ``finish_loss``; None once ``parts`` are the losses."""

    parts: list[Any] = field(default_factory=list)
    finish: Callable | None = None

    def part(self, m: int) -> Any:
        """Micro-batch ``m``'s part (None: this stage, or this step, holds no loss)."""
        return self.parts[m] if m < len(self.parts) else None

    def mean(self) -> torch.Tensor | None:
        """The mean of the losses (None: this stage computes none); waits for the losses'
        all-reduce where forward left it in flight."""
        if not self.parts:
            return None
        assert self.finish is not None or all(isinstance(x, torch.Tensor) for x in self.parts), \
            "a loss all-reduced in a gradient bucket is read after the step's backward"
        if self.finish is not None:
            self.parts = [self.finish(x) for x in self.parts]
            self.finish = None
        return self.parts[0] if len(self.parts) == 1 else torch.stack(self.parts).mean()


@dataclass
class StepInFlight:
    """One step between its forward and backward actions: the micro-batches, what each
    forward saved for its backward, the losses, the new buffer values (of the last
    micro-batch) and the gradients so far; ``pair``: the programs its mode picked,
    ``keeps_saved``: whether forward keeps what backward reads (not ``FORWARD_ONLY``).

    All of a step's state lives here, never on the runner, so a step is created and
    changed by the code that runs it: under ``torch.compile`` an autograd.Function's
    forward and backward are traced as separate scopes, neither of which may mutate an
    object the other made (``StepRunner.resume`` gives the backward its own step)."""

    micro_inputs: list[list[torch.Tensor]]
    loss: StepLoss
    pair: ProgramPair
    keeps_saved: bool = True
    saved: dict[int, list] = field(default_factory=dict)
    buffer_updates: list[torch.Tensor] = field(default_factory=list)
    raw: list[torch.Tensor | None] = field(default_factory=list)   # one per present gradient
    gathered: list[torch.Tensor] | None = None   # the parameters' copies made once per step


class StepRunner:
    """Forward, backward and gradient reduction of one rank's stage, micro-batch by
    micro-batch, in the order a schedule gives (one stage: the intra-op step)."""

    def __init__(self, program: StepPrograms, num_micro_batches: int = 1, *,
                 schedule: str = "1f1b", num_stages: int = 1, stage: int = 0,
                 exchange: Exchange | None = None, remat: bool = False):
        if (num_stages > 1) != (exchange is not None):
            raise ValueError("a stage of a multi-stage pipeline needs an exchange, and a "
                             "one-stage step has nobody to exchange with")
        if remat and exchange is None:
            raise ValueError("remat=True rematerializes a stage of a multi-stage pipeline; "
                             "a one-stage step checkpoints its layers with "
                             "AutoShardingOption(remat='full')")
        # keep only each micro-batch's inputs and run its forward again before its backward
        # (runtime/execution/stage_replay.py)
        self.remat = remat
        self.program = program
        self.num_micro_batches = num_micro_batches
        self.exchange = exchange
        self.actions: list[Action] = SCHEDULES[schedule](num_stages, num_micro_batches)[stage]

    @property
    def defers_backward(self) -> bool:
        """Whether the step's backward actions can wait for ``loss.backward()``: one stage."""
        return self.exchange is None

    def forward_actions(self) -> list[Action]:
        return [("F", m) for m in range(self.num_micro_batches)]

    def backward_actions(self) -> list[Action]:
        return [("B", m) for m in range(self.num_micro_batches)]

    def begin(self, inputs: Sequence[torch.Tensor], mode: StepMode) -> StepInFlight:
        """A step on the global batch ``inputs``, split into micro-batches (the one split),
        running the pair ``mode`` picks (``LOSS_LAST``: its backward actions run in the
        same ``run`` as its forward ones, and the loss is read after them)."""
        pair = self.program.pair(mode)
        present = sum(self.program.stage.grad_present)
        return StepInFlight(split_micro_batches(inputs, self.num_micro_batches),
                            StepLoss([], pair.finish_loss), pair, mode.keeps_saved,
                            raw=[None] * present)

    def resume(self, saved: Sequence[Sequence[torch.Tensor]]) -> StepInFlight:
        """A new step holding only what each micro-batch's forward saved (``saved[m]``),
        ready for the backward actions: what a deferred backward (``LOSS_FIRST``) runs on,
        built from the tensors the forward handed over instead of the forward's own step.
        A list in ``saved`` is taken over, not copied: backward frees its values as it goes
        once the caller keeps no other reference to them."""
        present = sum(self.program.stage.grad_present)
        return StepInFlight([], StepLoss([]), self.program.pair(StepMode.LOSS_FIRST),
                            saved={m: s if isinstance(s, list) else list(s)
                                   for m, s in enumerate(saved)},
                            raw=[None] * present)

    def run(self, step: StepInFlight, state: list[torch.Tensor], actions: list[Action]
            ) -> None:
        """Execute ``actions`` of ``step`` with its pair of programs."""
        exchange = self.exchange
        if exchange is not None:
            exchange.begin()
        for kind, m in actions:
            if kind == "F":
                self._forward(step, m, state)
            else:
                self._backward(step, m, state)
        if exchange is not None:
            exchange.finish(self.program.stage, step.raw, any(kind == "B" for kind, _ in actions))

    def _forward(self, step: StepInFlight, m: int, state: list[torch.Tensor]) -> None:
        """Micro-batch ``m``'s forward: its loss, sends and buffer updates delivered, what
        backward reads kept in ``step.saved[m]`` (or only how to replay it, under remat)."""
        stage, exchange = self.program.stage, self.exchange
        received = [exchange.recv(k, m) for k in stage.forward_recvs] if exchange else []
        rng = random_state(_device_of(state, received)) if self.remat else None
        out = list(step.pair.forward(*state, *[step.micro_inputs[m][i] for i in stage.user_inputs],
                           *received, *self._gathered(step, state, m)))
        if stage.has_loss:
            step.loss.parts.append(out.pop(0))
        for k in stage.forward_sends:
            assert exchange is not None
            exchange.send(k, out.pop(0), m)
        n = len(stage.buffer_updates)
        if n:
            step.buffer_updates, out = out[:n], out[n:]
        if step.keeps_saved:
            step.saved[m] = out if rng is None else [Replay(m, received, rng)]

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
        if m == self.num_micro_batches - 1 and not self.remat:
            step.gathered = None    # a replayed forward (remat) reads them in backward
        return gathered

    def _replay(self, step: StepInFlight, state: list[torch.Tensor], replay: Replay) -> list:
        """What micro-batch ``replay.micro``'s forward saved, by running that forward again
        on its inputs from its random state (its loss, sends and buffer updates were
        delivered by the first run and are dropped)."""
        stage = self.program.stage
        with replaying(replay.rng, _device_of(state, replay.received)):
            out = list(stage.forward(*state, *[step.micro_inputs[replay.micro][i]
                                                for i in stage.user_inputs], *replay.received,
                                     *(step.gathered or ())))
        return out[stage.num_results:]

    def _backward(self, step: StepInFlight, m: int, state: list[torch.Tensor]) -> None:
        stage, exchange = self.program.stage, self.exchange
        saved = step.saved.pop(m)
        if saved and isinstance(saved[0], Replay):
            saved = self._replay(step, state, saved[0])
        received = [exchange.recv(k, m) for k in stage.backward_recvs] if exchange else []
        backward, part = step.pair.backward, step.loss.part(m)
        grads: Sequence = ()
        if getattr(backward, "summing", None) is None:
            grads, sends, loss = backward(saved, received, part)
        elif any(r is None for r in step.raw):    # the first: copies of its own start the sums
            sums, sends, loss = backward.start(saved, received, part)
            step.raw = [g for g in sums if g is not None]
        else:       # each gradient added into the sums as backward makes it
            sends, loss = backward.add_into(saved, received, part, step.raw)
        del saved
        if loss is not None:
            step.loss.parts[m] = loss
        # one gradient per parameter, None: unused
        for i, g in enumerate(g for g in grads if g is not None):
            # out of place: a raw gradient may alias a value the caller still holds
            step.raw[i] = g if step.raw[i] is None else step.raw[i] + g
        for k, v in zip(stage.backward_sends, sends):
            assert exchange is not None
            exchange.send(k, v, m)

    def loss(self, step: StepInFlight) -> torch.Tensor | None:
        """The mean of the step's micro-batch losses (None: this stage computes none).
        Waits for the losses' all-reduce, which forward left in flight: call it as late as
        the loss is needed (after backward, in ``train_step``) to overlap the two."""
        return step.loss.mean()

    def gradients(self, step: StepInFlight, scale: torch.Tensor | float | None = None
                  ) -> list[torch.Tensor | None]:
        """Gradients of ``scale * mean loss`` in their parameters' layouts, one per
        parameter of the stage (None: unused): the plan's resharding runs once here."""
        # the sums handed over as a list the program empties: each is freed once its
        # bucket is packed (``release_inputs``), not held beside the reduced gradients
        raw, step.raw = step.raw, []
        reduced = iter(call_releasing(step.pair.reduce_grads, raw))
        grads = [next(reduced) if present else None
                 for present in self.program.stage.grad_present]
        factor = 1.0 / self.num_micro_batches
        # several micro-batches: every reduced gradient is made from the step's own sums
        # (none aliases what the caller holds), so it is scaled in place; out of place,
        # each scaled copy would be alive beside all the reduced gradients (``grads``
        # holds them): twice the gradients at the step's end, which the plan does not price
        in_place = factor != 1.0 and not torch.compiler.is_compiling()
        out = []
        for g in grads:
            if g is not None:
                if scale is not None:
                    g = g * scale
                if factor != 1.0:
                    g = g.mul_(factor) if in_place else g * factor
            out.append(g)
        return out


def _device_of(*groups: Sequence[torch.Tensor]) -> torch.device | None:
    """The device of the first tensor in ``groups`` (whose random state a replay keeps)."""
    for group in groups:
        for t in group:
            if isinstance(t, torch.Tensor):
                return t.device
    return None
