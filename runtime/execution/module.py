"""ParallelModule: the user's model, its parameters as DTensors, its step as local programs.

One class for every method: an intra-op plan is a one-stage pipeline, and a pipeline
stage's rank holds only its stage's parameters, as DTensors on its stage's submesh (the
other stages' parameters are DTensors on meshes it is not part of: no local data, no
gradient, skipped by the optimizer). One runner (``runtime.execution.step.StepRunner``) splits the
global batch into micro-batches and runs the stage's programs through the schedule.

Parameters are swapped in place for DTensors with the planned placements (as FSDP2's
``fully_shard`` does, see ``runtime.execution.materialize``), so ``pmodel.parameters()`` feeds any
``torch.optim`` optimizer, ``clip_grad_norm_`` and LR schedulers, and optimizer states are
sharded like the parameters. What a call runs depends on the model's mode:

- the mode it was captured in (normally training), with autograd on: this rank's forward
  program now, its backward program on ``loss.backward()``; gradients land on the
  DTensor parameters in their planned layouts;
- the same mode under ``torch.no_grad()``: the forward program only;
- the other mode (``pmodel.eval()`` after training): a forward-only program of the
  eval-mode step (``runtime.serving.inference``), returning the loss without backward.

A stage of a longer pipeline cannot wait for ``loss.backward()`` (1F1B interleaves the
stages' forward and backward work), so there a call with autograd on runs the whole step
and ``loss.backward()`` hands each parameter its gradient (times the loss's gradient):
the same ``loss = pmodel(x, y); loss.backward(); opt.step()`` loop works. The loss comes
from the last stage, broadcast to every rank.

``train_step`` runs forward and backward micro-batch by micro-batch without autograd and
steps the optimizer once; ``predict`` returns the model's outputs, whole on every rank.

Random ops (dropout) draw from each rank's default generator, which ``auto_parallel``
synchronizes across ranks (``runtime/lowering/random_draws.py``); ``check_replicas`` verifies before each
step that replicated parameters, buffers and the generator state still agree across ranks
(``runtime/resilience/replicas.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.tensor import DTensor

from torchalpa.core.calls import CallSignature
from torchalpa.core.plan import Collective, PipelinePlan, Plan
from torchalpa.runtime.execution.host_optimizer import (
    host_optimizer,
    offloads,
    offloads_parameters,
    parameters_to_host,
)
from torchalpa.runtime.execution.materialize import distribute_module_state, to_dtensor_placements
from torchalpa.runtime.execution.mesh import collective_timeout
from torchalpa.runtime.execution.optim import lean_optimizer_steps
from torchalpa.runtime.execution.pending_loss import LossBox, PendingLoss
from torchalpa.runtime.execution.step import StepMode, StepRunner
from torchalpa.runtime.measurement.issued import issued_collectives
from torchalpa.runtime.measurement.stats import StepClock, StepStats
from torchalpa.runtime.resilience.faults import (
    FaultMonitor,
    check_same_inputs,
    check_same_values,
    describe_specs,
)
from torchalpa.runtime.resilience.replicas import (
    ReplicaMismatchError,
    enabled_by_env,
    raise_on_every_rank,
)
from torchalpa.runtime.resilience.replicas import check_replicas as _check_replicas
from torchalpa.runtime.rewrites.buckets import LossInBucket
from torchalpa.runtime.serving.inference import ForwardPrograms

__all__ = ["ParallelModule", "to_dtensor_placements", "distribute_module_state"]

NEEDS_OPTIMIZER = ("train_step needs an optimizer: pass auto_parallel(..., optimizer=lambda ps: "
                   "torch.optim.Adam(ps, lr=1e-3)) or set pmodel.optimizer = "
                   "torch.optim.Adam(pmodel.parameters())")


class _TrainingStep(torch.autograd.Function):
    """One stage (intra-op): the forward actions now, the backward ones on
    ``loss.backward()``. A stage of a longer pipeline: the whole step now, its gradients
    handed out on ``loss.backward()``. Returns the loss, then the step's new buffer
    values (not differentiable), which the caller stores.

    ``torch.compile`` traces forward and backward as separate scopes that may not mutate
    anything made outside them. So the forward's step stays in the forward: what each
    micro-batch saved goes to backward through ``ctx.save_for_backward``, and backward
    resumes on a step of its own (``StepRunner.resume``); buffer write-backs happen after
    ``apply``, outside both. Eager, the values forward saved are held by ``ctx`` alone, so
    backward frees each at its last use (a second backward of one step is refused), and in
    a plain ``loss.backward()`` the gradients AccumulateGrad would only store are set on
    the parameters here (``_hand_over``)."""

    @staticmethod
    def forward(ctx, pm: ParallelModule, num_state: int, sentinel, *args):
        # the parameters come as themselves (DTensors): their gradients are made DTensors
        # here, sharing each parameter's layout spec, not by ``to_local``'s backward, which
        # builds a spec per parameter (``from_local``) and adds an autograd node each
        state = [t._local_tensor if isinstance(t, DTensor) else t for t in args[:num_state]]
        inputs = args[num_state:]
        params = args[:len(pm._param_names)]
        ctx.wrap = [(t._spec, t._local_tensor.shape, t.dtype, t.shape, t.stride())
                    if isinstance(t, DTensor) else None for t in params]
        # eager: gradients may be handed to the parameters directly (``_hand_over``)
        ctx.params = params if sentinel is not None else None
        runner = pm._runner
        with pm._monitor.guard(f"the forward of step {pm._num_calls}"):
            step = runner.begin(inputs, StepMode.LOSS_FIRST)
            if runner.defers_backward:
                runner.run(step, state, runner.forward_actions())
                saved = [step.saved[m] for _, m in runner.forward_actions()]
                ctx.counts = [len(s) for s in saved]
                if torch.compiler.is_compiling():
                    ctx.save_for_backward(*[t for s in saved for t in s])
                    ctx.held = None
                else:   # freed one by one as backward reads them (``_HeldForBackward``)
                    ctx.held = _HeldForBackward(saved)
                step.saved.clear()      # the step's loss stays in flight: hold no values
                del saved
                ctx.grads = None
            else:
                runner.run(step, state, runner.actions)
                ctx.counts, ctx.grads = None, runner.gradients(step)
            loss, ctx.loss_box = pm._loss_in_flight(step)
        ctx.pm = pm
        ctx.num_others = len(args) - len(pm._param_names)
        ctx.mark_non_differentiable(*step.buffer_updates)
        return (loss, *step.buffer_updates)

    @staticmethod
    def backward(ctx, grad_loss, *_grad_buffer_updates):
        # The programs seed backward with d(loss) = 1; gradients are linear in that seed.
        # (.item() would break a torch.compile graph: traced, the seed is always passed)
        unit = grad_loss is None or (not torch.compiler.is_compiling()
                                     and grad_loss.device.type == "cpu" and grad_loss.item() == 1.0)
        pm = ctx.pm
        if ctx.counts is not None:
            if ctx.held is not None:
                saved = ctx.held.take()
            else:
                flat, saved, start = ctx.saved_tensors, [], 0
                for n in ctx.counts:
                    saved.append(flat[start:start + n])
                    start += n
            step = pm._runner.resume(saved)
            del saved
            with pm._monitor.guard(f"the backward of step {pm._num_calls}"):
                pm._runner.run(step, [], pm._runner.backward_actions())
                grads = pm._runner.gradients(step, None if unit else grad_loss)
        else:
            grads = [g if unit or g is None else g * grad_loss for g in ctx.grads]
        if ctx.loss_box is not None:     # its all-reduce went before the gradients'
            ctx.loss_box.value()
        pm._clock.stop("forward+backward")
        grads = [_as_parameter_grad(g, w) for g, w in zip(grads, ctx.wrap, strict=True)]
        if ctx.params is not None and pm._plain_backward():
            grads = _hand_over(ctx.params, grads)
        return (None, None, None, *grads, *([None] * ctx.num_others))


def _hand_over(params: Sequence[torch.Tensor], grads: list) -> list:
    """Set each gradient that AccumulateGrad would only store (no ``p.grad`` yet, no hook
    on the parameter, its layout) as ``p.grad`` here, and give autograd None for it: its
    AccumulateGrad would detach each DTensor gradient through DTensor dispatch (about 7 us
    each, ``benchmarks/dtensor_grad_glue.py``). The others go through autograd as before."""
    out = []
    for p, g in zip(params, grads):
        if isinstance(g, DTensor) and isinstance(p, DTensor) and p.grad is None \
                and not p._backward_hooks \
                and not p._post_accumulate_grad_hooks and p.requires_grad \
                and g._local_tensor.is_contiguous() and p._local_tensor.is_contiguous():
            p.grad = g
            g = None
        out.append(g)
    return out


class _HeldForBackward:
    """What a step's forward saved for its backward, held outside autograd's saved tensors.

    Autograd keeps a function's saved tensors until its backward returns; the runtime's
    backward programs free each saved value once they have read it
    (``runtime/rewrites/release_inputs.py``), as eager autograd frees each op's, and as
    the plan's memory estimate assumes. So ``loss.backward()`` takes them from here, once,
    and the step owns them. Like autograd, it refuses values changed in place since
    forward (a parameter stepped before ``loss.backward()``)."""

    def __init__(self, saved: list[list]):
        self.saved: list[list] | None = saved
        self.versions = [[t._version if isinstance(t, torch.Tensor) else None for t in s]
                         for s in saved]

    def take(self) -> list[list]:
        saved, self.saved = self.saved, None
        if saved is None:
            raise RuntimeError(
                "this step's backward already ran: torchalpa frees the values a step saved "
                "for backward as its backward goes, as autograd does without "
                "retain_graph=True (which it does not support); call the model again "
                "(loss = pmodel(x, y)) before another backward")
        for values, versions in zip(saved, self.versions):
            for t, version in zip(values, versions):
                if version is not None and t._version != version:
                    raise RuntimeError(
                        f"a tensor the step's forward saved for backward (shape "
                        f"{tuple(t.shape)}) was modified in place before loss.backward() "
                        f"(version {version} -> {t._version}): run the optimizer after "
                        f"backward, and change no input in place in between")
        return saved


def _as_parameter_grad(g: torch.Tensor | None, wrap) -> torch.Tensor | None:
    """A local gradient as its parameter's (a DTensor in the parameter's layout)."""
    if g is None or wrap is None:
        return g
    spec, local_shape, dtype, shape, stride = wrap
    if g.dtype == dtype and g.shape == local_shape:    # the parameter's layout: its spec
        return DTensor(g, spec, requires_grad=False)  # pyright: ignore[reportCallIssue]
    return DTensor.from_local(g, spec.mesh, spec.placements, run_check=False, shape=shape,
                              stride=stride)


def _attach_gradients(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                      *, clear_missing: bool = False) -> None:
    """Set ``p.grad`` for each parameter with a gradient (its local block, in the
    parameter's layout); a None gradient leaves ``p.grad`` as it is, or sets it to None
    with ``clear_missing``.

    ``DTensor.from_local`` builds a new layout spec each call: some tens of microseconds
    per parameter, every step. A gradient with its parameter's dtype and local shape has
    its parameter's layout, so it shares the parameter's spec and is wrapped directly;
    ``from_local`` remains for the others."""
    for p, g in zip(params, grads):
        if g is None:
            if clear_missing:
                p.grad = None
            continue
        if not isinstance(p, DTensor):
            p.grad = g
        elif g.dtype == p.dtype and g.shape == p._local_tensor.shape:
            p.grad = DTensor(g, p._spec, requires_grad=False)  # pyright: ignore[reportCallIssue]
        else:
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())


def _check_streamable(plan) -> None:
    """Parameters streamed from host memory reduce their gradients there: a collective
    backend that reaches host memory (gloo) or one device."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if isinstance(plan, PipelinePlan):
        raise NotImplementedError("offload_parameters is planned for intra-op plans, not "
                                  "pipelines: plan without offload_parameters")
    if world > 1 and dist.get_backend() != "gloo":
        raise NotImplementedError(
            f"offload_parameters reduces gradients in host memory, which the "
            f"{dist.get_backend()} backend cannot reach across {world} ranks: run it on one "
            "device, or offload only the optimizer states (offload=True)")


def _signed_like(call: Callable, model_forward: Callable) -> Callable:
    """``call`` advertising ``model_forward``'s signature to ``inspect.signature``."""
    def forward(*args, **kwargs):
        return call(*args, **kwargs)
    forward.__doc__ = call.__doc__
    try:
        forward.__signature__ = inspect.signature(model_forward)  # type: ignore[attr-defined]
    except (TypeError, ValueError):     # a builtin without one: keep the generic signature
        pass
    return forward


class ParallelModule(nn.Module):
    """A model parallelized by torchalpa: call it like the single-device model.

    ``module``: the user's model, its parameters swapped for DTensors; ``plan``; ``mesh``:
    this rank's (its stage's) DeviceMesh; ``optimizer``: over the parallel parameters, or
    None. Checkpoints, ``isinstance`` checks and tools read this surface."""

    plan: Plan | PipelinePlan

    def __init__(self, module: nn.Module, plan: Plan | PipelinePlan, runner: StepRunner,
                 mesh, *, input_specs: list[tuple[tuple[int, ...], torch.dtype]],
                 device: torch.device, inputs: str = "global",
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 forward_programs: ForwardPrograms | None = None,
                 signature: CallSignature | None = None, check_replicas: bool | None = None,
                 check_inputs: str = "first", stage: int = 0):
        """``runner``: this rank's stage's programs (the whole graph for an intra-op
        plan); ``mesh``: its stage's DeviceMesh; ``stage``: its index in a PipelinePlan;
        ``check_replicas``: None reads ``TORCHALPA_CHECK_REPLICAS``. A peer is declared
        failed after the collective timeout (``TORCHALPA_TIMEOUT_S``)."""
        super().__init__()
        self.module = module
        self.plan = plan
        self.mesh = mesh
        self._device = device
        self.stage = stage
        self.num_micro_batches = runner.num_micro_batches
        self._program = runner.program.stage
        self._runner = runner
        self._stage_plan = plan.stages[stage].plan if isinstance(plan, PipelinePlan) else plan
        # an intra-op step gathers its parameters once per step (runtime.rewrites.param_gather)
        self._one_stage = not isinstance(plan, PipelinePlan)
        # where the loss is computed when another stage computes it: broadcast from there
        self._loss_rank = plan.stages[-1].ranks[0] if isinstance(plan, PipelinePlan) \
            and len(plan.stages) > 1 else None
        self._forward_programs = forward_programs
        self._param_names = list(self._program.params)
        self._buffer_names = list(self._program.buffers)
        self._input_specs = list(input_specs)
        self._inputs = inputs
        self._captured_training = module.training
        self._monitor = FaultMonitor(collective_timeout().total_seconds())
        self._checked_across_ranks = False
        self._check_values = check_inputs if inputs == "global" else "never"
        self._num_calls = 0
        self._check_every_step = enabled_by_env() if check_replicas is None \
            else bool(check_replicas)
        self._signature = signature if signature is not None else CallSignature(len(input_specs))
        self._clock = StepClock(device)
        # how train_step reads the loss (after backward; the pair for it was built with the
        # step's programs, runtime.rewrites.program_rewrites.step_programs)
        self._train_step_mode = StepMode.LOSS_LAST
        self._last_loss_in_bucket: LossInBucket | None = None   # the last step's, if any
        # the autograd path's loss while its all-reduce is in flight (pending_loss.py)
        self._pending: LossBox | None = None
        # a leaf the autograd path's function takes, to ask autograd which backward runs
        self._grad_sentinel: torch.Tensor | None = None
        self._sentinel_node = None
        self._loss_like: torch.Tensor | None = None     # its shape and dtype
        self._slots: dict[str, tuple[dict, str]] = {}   # name -> (owner's entries, key)
        self._exact_optimizer: tuple = (None, False)     # (its key, holds exactly our params)
        # Adam & co. step on the local shards; a stage's optimizer also holds the other
        # stages' parameters (no local data here), so pipelines keep the plain step
        self._lean_step = self._loss_rank is None
        if self._lean_step:
            lean_optimizer_steps(self.parameters())
        # parameters in host memory, streamed per op (runtime.rewrites.param_stream)
        streamed = offloads_parameters(plan)
        if streamed:
            _check_streamable(plan)
            parameters_to_host(self.parameters())
        # the optimizer over the parallel parameters (DTensors), if one is given
        # (over host copies of the local blocks where the plan offloads its states)
        self.optimizer: torch.optim.Optimizer | None = None if optimizer is None else \
            host_optimizer(optimizer, self.parameters(), shared=streamed) if offloads(plan) \
            else optimizer(self.parameters())
        # tools that read the forward's parameters to pick batch fields (HF Trainer drops
        # the columns ``model.forward`` does not name) see the wrapped model's
        self.forward = _signed_like(self.forward, module.forward)
        # the captured step computes the loss as it was captured (a mean over the batch); it
        # takes no loss keywords such as HF's ``num_items_in_batch``, so Trainer must not send them
        self.accepts_loss_kwargs = False
        # HF Trainer's flag for a model that owns its placement and gradient reduction:
        # under torchrun it then neither wraps it in DDP nor moves it (see test_hf_trainer)
        self.is_distributed_loading_by_transformers = True

    def _apply(self, fn, recurse=True):
        """``Module.to()`` / ``float()`` and the like; converted parameters are marked again
        for the local-shard optimizer step (a swap may replace their attributes)."""
        out = super()._apply(fn, recurse)
        if self._lean_step:
            lean_optimizer_steps(self.parameters())
        return out

    # -- the step -----------------------------------------------------------------------
    def forward(self, *inputs: torch.Tensor, **kwargs: torch.Tensor):
        """The loss of one step on the given batch (every rank returns the same value).

        Called as the example inputs were given: positionally, or by keyword
        (``pmodel(input_ids=ids, labels=labels)``); then the loss comes in the forward's own
        output type (``outputs.loss``, ``outputs["loss"]``), its other fields unset."""
        flat = self._check_inputs(self._signature.flatten(inputs, kwargs))
        self._num_calls += 1
        if self._check_every_step:
            self.check_replicas()
        if self._other_mode():
            return self._signature.wrap_loss(self._forward_only(flat, outputs=False))
        self._clock.start(flat)
        self._last_loss_in_bucket = None   # returned before backward: its own all-reduce
        if not torch.is_grad_enabled():
            with self._monitor.guard(f"the forward of step {self._num_calls}"):
                step = self._runner.begin(flat, StepMode.FORWARD_ONLY)
                self._runner.run(step, self._state(self._param_names + self._buffer_names),
                                 self._runner.forward_actions())
                loss = self._loss(step)
            self._write_buffer_updates(step.buffer_updates)
            self._clock.stop("forward")
            return self._signature.wrap_loss(loss)
        names = self._param_names + self._buffer_names
        # compiled, the local blocks go in (dynamo cannot keep DTensor specs on the
        # function's context); eager, the DTensors themselves (no to_local node each)
        state = self._state(names, differentiable=True) if torch.compiler.is_compiling() \
            else self._tensors(names)
        loss, *buffer_updates = _TrainingStep.apply(self, len(state), self._sentinel(state),
                                                    *state, *flat)
        self._write_buffer_updates(buffer_updates)
        return self._signature.wrap_loss(loss)

    def _sentinel(self, state: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """A leaf the step's autograd function also takes (eager, some parameter trained):
        its AccumulateGrad node runs only in a backward over the whole graph
        (``_plain_backward``)."""
        if torch.compiler.is_compiling() or not any(t.requires_grad for t in state):
            return None
        if self._grad_sentinel is None:
            self._grad_sentinel = torch.zeros((), requires_grad=True)
            self._sentinel_node = get_gradient_edge(self._grad_sentinel).node
        return self._grad_sentinel

    def _plain_backward(self) -> bool:
        """Whether the running backward is a ``loss.backward()`` that accumulates into every
        leaf (no ``inputs=``, not ``torch.autograd.grad``, no ``create_graph``): then the
        step may set the parameters' gradients itself (``_hand_over``)."""
        if torch.is_grad_enabled() or self._sentinel_node is None:
            return False
        try:
            return torch._C._will_engine_execute_node(self._sentinel_node)
        except RuntimeError:      # the engine refuses the question for a captured leaf
            return False

    def _other_mode(self) -> bool:
        """Called in the mode the step was not captured in, with eval programs to run
        (a pipeline has none: its stages run the captured step in either mode)."""
        return self._forward_programs is not None and \
            self.module.training != self._captured_training

    def _loss(self, step) -> torch.Tensor:
        """The step's mean loss, on every rank (broadcast from the last stage's first rank
        when this rank's stage computes none)."""
        loss = self._runner.loss(step)
        if self._loss_rank is None:
            assert loss is not None, "a one-stage step computes the loss"
            return loss
        loss = torch.zeros((), device=self._device) if loss is None else loss.detach().clone()
        dist.broadcast(loss, src=self._loss_rank)
        return loss

    def _loss_in_flight(self, step) -> tuple[torch.Tensor, LossBox | None]:
        """The step's loss for the autograd path, and its box: where forward left the
        loss's all-reduce in flight (one stage, eager), a ``PendingLoss`` waited for on
        first read or at the end of backward (``runtime/execution/pending_loss.py``: the
        ranks then meet once a step, in backward, as DDP's do); else the loss (no box).
        The first step's loss is waited for here: it lends the shape and dtype."""
        if torch.compiler.is_compiling():    # traced: no state kept across calls
            return self._loss(step), None
        if self._pending is not None:        # the last step's, never read nor backpropagated
            self._pending.value()
            self._pending = None
        if self._loss_rank is not None or step.loss.finish is None or self._loss_like is None:
            loss = self._loss(step)
            self._loss_like = torch.empty_like(loss) if self._loss_rank is None else None
            return loss, None
        losses, what = step.loss, f"the loss of step {self._num_calls}"

        def finish() -> torch.Tensor:
            with self._monitor.guard(what):     # a peer that failed is named, as in forward
                loss = losses.mean()
            assert loss is not None, "a one-stage step computes the loss"
            return loss

        self._pending = box = LossBox(finish)
        return PendingLoss(box, self._loss_like), box

    def _write_buffer_updates(self, values: Sequence[torch.Tensor],
                              names: Sequence[str] | None = None) -> None:
        """Store the new values a step computed for buffers (batch-norm running
        statistics) in the buffers' own layouts (their local shards when they are
        DTensors); with micro-batches, the last one's. ``names``: the step program's
        buffer updates unless given."""
        names = self._program.buffer_updates if names is None else names
        with torch.no_grad():
            for name, value in zip(names, values):
                buf = self.module.get_buffer(name)
                (buf.to_local() if isinstance(buf, DTensor) else buf).copy_(value)

    def train_step(self, *inputs: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """zero_grad, forward and backward (micro-batch by micro-batch), optimizer step;
        returns the loss (the mean over micro-batches). Inputs as for ``forward``."""
        optimizer = self.optimizer
        if optimizer is None:
            raise ValueError(NEEDS_OPTIMIZER)
        if self._other_mode():
            mode = "training" if self._captured_training else "eval"
            raise ValueError(f"train_step runs the step captured in {mode} mode, but the model is "
                             f"now in {'training' if self.module.training else 'eval'} mode; "
                             f"call pmodel.{'train' if self._captured_training else 'eval'}() "
                             "first")
        flat = self._check_inputs(self._signature.flatten(inputs, kwargs))
        self._num_calls += 1
        if self._check_every_step:
            self.check_replicas()
        self._clock.start(flat)
        with self._monitor.guard(f"step {self._num_calls}"), torch.no_grad():
            tensors = self._tensors(self._param_names + self._buffer_names)
            step = self._runner.begin(flat, self._train_step_mode)
            self._runner.run(step, self._local_blocks(tensors), self._runner.actions)
            grads = self._runner.gradients(step)
            loss = self._loss(step)     # after backward: its all-reduce overlapped with it,
            # or sent inside a gradient bucket
            self._last_loss_in_bucket = step.pair.loss_in_bucket
        self._write_buffer_updates(step.buffer_updates)
        params = tensors[:len(self._param_names)]
        if self._steps_exactly(optimizer, params):    # every gradient set below: no zero_grad
            _attach_gradients(params, grads, clear_missing=True)
        else:
            optimizer.zero_grad(set_to_none=True)
            _attach_gradients(params, grads)
        optimizer.step()
        self._clock.stop("forward+backward+optimizer")
        return loss.detach()

    def _steps_exactly(self, optimizer: torch.optim.Optimizer,
                       params: Sequence[torch.Tensor]) -> bool:
        """Whether ``optimizer`` holds exactly ``params``: then setting each one's gradient
        (None where it has none) is ``zero_grad(set_to_none=True)`` plus the gradients,
        without a second walk over the parameters (remembered per optimizer and groups)."""
        groups = optimizer.param_groups
        key = (id(optimizer), len(groups), sum(len(g["params"]) for g in groups),
               tuple(map(id, params)))
        if self._exact_optimizer[0] != key:
            held = {id(p) for g in groups for p in g["params"]}
            self._exact_optimizer = (key, held == {id(p) for p in params})
        return self._exact_optimizer[1]

    @torch.no_grad()
    def predict(self, *inputs: torch.Tensor, **kwargs: torch.Tensor):
        """The model's outputs on ``inputs`` (model inputs only, no targets; by position or
        by keyword), whole on every rank. Planned and lowered on first use per input shape,
        with the parameters in their training layouts; dropout and the like follow the
        model's mode."""
        if self._forward_programs is None:
            raise ValueError("predict needs forward-only programs, which pipelines "
                             "(PipeshardParallel) do not build; parallelize the model with "
                             "ShardParallel to predict (torchalpa.save_checkpoint(path, pmodel) "
                             "here, then torchalpa.load_checkpoint(path, that model): a "
                             "checkpoint loads into any plan)")
        if inputs and kwargs:
            raise TypeError("predict takes the model inputs by position or by keyword, not both")
        keywords = tuple(kwargs)
        inputs = tuple(kwargs.values()) if kwargs else inputs
        specs = self._tensor_specs(inputs)
        check_same_inputs(specs, "input shapes to predict")
        self._num_calls += 1
        return self._forward_only([x.to(self._device) for x in inputs], outputs=True,
                                  keywords=keywords)

    def generate(self, *args, **kwargs):
        """Not for a model wrapped for training: a ValueError saying how to wrap for
        generation (its prefill and decode steps are other programs, with a KV cache)."""
        del args, kwargs
        if isinstance(self.plan, PipelinePlan):
            raise ValueError(
                "this model was wrapped for pipelined training (PipeshardParallel), and "
                "generation is not pipelined: pm.unwrap().generate(...) runs on one device "
                "with the whole model gathered (every rank calls unwrap), or wrap it for "
                "inference with ShardParallel: torchalpa.auto_parallel(model, prompt_ids, "
                "mode='inference', method=torchalpa.ShardParallel())")
        raise ValueError(
            "this model was wrapped for training (auto_parallel's mode='training'), whose "
            "programs have no KV cache; to generate, wrap it for inference: "
            "torchalpa.auto_parallel(model, prompt_ids, mode='inference') (or "
            "mode=torchalpa.Inference(max_context=...)), with prompt_ids (batch, prompt "
            "length) the largest batch to generate at once. pm.unwrap().generate(...) runs "
            "on one device with the whole model gathered")

    def _forward_only(self, inputs: list[torch.Tensor], *, outputs: bool,
                      keywords: tuple[str, ...] = ()) -> Any:
        specs = [(self._global_shape(x.shape), x.dtype) for x in inputs]
        assert self._forward_programs is not None
        fp = self._forward_programs.get(specs, outputs=outputs, training=self.module.training,
                                        keywords=keywords)
        with self._monitor.guard(f"forward-only call {self._num_calls}"), torch.no_grad():
            outs = fp.program(*self._state(fp.state_names), *inputs)
            # batch-norm statistics in train mode
            self._write_buffer_updates(outs[1:1 + len(fp.buffer_updates)], fp.buffer_updates)
        return fp.unflatten(outs[0])

    def check_replicas(self) -> None:
        """Raise ``ReplicaMismatchError`` (on every rank) if a replicated parameter or
        buffer, or the default random generator, differs across ranks (of this rank's
        stage, for a pipeline). Costs a hash of each local block and one small all-gather
        per mesh axis (and one across all ranks, for a pipeline)."""
        named = [(n, self._tensor(n)) for n in self._param_names + self._buffer_names]
        with self._monitor.guard(f"the replica check of step {self._num_calls}"), \
                torch.no_grad():
            if self._loss_rank is None:
                _check_replicas(named, self.mesh, device=self._device)
                return
            error = None      # a pipeline: this stage's replicas, then every rank agrees
            try:
                _check_replicas(named, self.mesh, device=self._device)
            except ReplicaMismatchError as e:
                error = e
            raise_on_every_rank(error)

    # -- helpers ------------------------------------------------------------------------
    def _state(self, names: Sequence[str], differentiable: bool = False) -> list[torch.Tensor]:
        """This rank's blocks of the named parameters and buffers."""
        return self._local_blocks(self._tensors(names), differentiable)

    def _tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The named parameters and buffers (DTensors where distributed), read now from
        their owning modules: a swap (``.to()``, loading a checkpoint) may have replaced
        them since the last step. Each owner is found once (``get_parameter`` walks the
        module tree: some microseconds per name, every step) and its entry read each time."""
        out = []
        for name in names:
            slot = self._slots.get(name)
            value = None if slot is None else slot[0].get(slot[1])
            if value is None:          # first use, or the owner no longer holds it
                value = self._tensor(name)
                module_path, _, attr = name.rpartition(".")
                owner = self.module.get_submodule(module_path)
                entries = owner._parameters if attr in owner._parameters else owner._buffers
                self._slots[name] = (entries, attr)
            out.append(value)
        return out

    @staticmethod
    def _local_blocks(tensors: Sequence[torch.Tensor], differentiable: bool = False
                      ) -> list[torch.Tensor]:
        """This rank's block of each tensor (``to_local`` keeps autograd's link)."""
        if differentiable:
            return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]

    def _tensor(self, name: str) -> torch.Tensor:
        try:
            return self.module.get_parameter(name)
        except AttributeError:
            return self.module.get_buffer(name)

    def _global_shape(self, shape) -> tuple[int, ...]:
        if self._inputs == "global" or not len(shape):
            return tuple(shape)
        return (shape[0] * self.mesh.size(),) + tuple(shape[1:])

    @staticmethod
    def _tensor_specs(inputs) -> list[tuple[tuple[int, ...], torch.dtype]]:
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {i} must be a tensor, got {type(x).__name__}")
            if x.device.type == "meta":
                raise ValueError(f"input {i} is on the meta device, which holds no values to "
                                 "run: pass real tensors (meta inputs are for torchalpa.plan, "
                                 "which plans without running)")
        return [(tuple(x.shape), x.dtype) for x in inputs]

    def _check_inputs(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        expected = describe_specs(self._input_specs)
        if len(inputs) != len(self._input_specs):
            raise TypeError(f"expected {len(self._input_specs)} inputs (model inputs, then loss "
                            f"targets) shaped {expected}, got {len(inputs)}")
        specs = self._tensor_specs(inputs)
        kind = "global batch" if self._inputs == "global" else "local shard"
        first = not self._checked_across_ranks
        if first:
            check_same_inputs(specs, f"{kind} shaped {expected}")
            self._checked_across_ranks = True
        if self._check_values == "always" or (first and self._check_values == "first"):
            check_same_values(inputs, "batch")
        if self._other_mode():
            return [x.to(self._device, non_blocking=True) for x in inputs]
        out = []
        for i, (x, (shape, dtype)) in enumerate(zip(inputs, self._input_specs)):
            if tuple(x.shape) != tuple(shape) or x.dtype != dtype:
                error = ValueError(
                    f"input {i} is {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}, but "
                    f"the plan was made for a {kind} of {tuple(shape)} "
                    f"{str(dtype).removeprefix('torch.')} (all inputs: {expected}); call "
                    "auto_parallel again with example inputs of the new shape")
                self._monitor.record(error)
                raise error
            out.append(x.to(self._device, non_blocking=True))
        return out

    # -- inspection and export -----------------------------------------------------------
    def last_step_stats(self) -> StepStats:
        """The last complete step: time, tokens/s, peak memory and the bytes the plan says
        it sent, each next to the plan's estimate (``print(pm.last_step_stats())``)."""
        return self._clock.stats(self._stage_plan, self.num_micro_batches,
                                 loss_in_bucket=self._last_loss_in_bucket,
                                 one_stage=self._one_stage)

    def collectives_per_step(self, *, train_step: bool) -> list[Collective]:
        """The collectives one step of this rank's stage issues, as the plan lists them
        (gradient buckets once, ``runtime.rewrites.buckets.issued_collectives``): by ``train_step``,
        whose loss may be all-reduced in a gradient bucket (``runtime.rewrites.loss_in_bucket``), or
        by a call of the module and ``loss.backward()``, which returns the loss before
        backward and so all-reduces it on its own."""
        mode = self._train_step_mode if train_step else StepMode.LOSS_FIRST
        return issued_collectives(self._stage_plan, self.num_micro_batches,
                                  loss_in_bucket=self._runner.program.pair(mode).loss_in_bucket,
                                  one_stage=self._one_stage)

    def profile(self, steps: int, path, *inputs: torch.Tensor, **kwargs: torch.Tensor) -> str:
        """Record ``steps`` training steps on the batch ``inputs`` (as ``train_step`` takes
        it) with ``torch.profiler`` and write this rank's Chrome trace to ``path`` (Perfetto),
        the plan's collectives labelled by kind, mesh axis and bytes; returns the file
        written (``runtime/measurement/timeline.py``). The steps are real: parameters change."""
        from torchalpa.runtime.measurement.timeline import profile_steps
        return profile_steps(self, steps, path, inputs, kwargs)

    def unwrap(self) -> nn.Module:
        """A plain copy of the model with full, gathered tensors (no DTensors): for
        ``generate()``, ``torch.save`` or single-device evaluation. Every rank must call it
        (it gathers), and every rank gets the whole model (a pipeline's stages included),
        beside its own shards. To write the model, ``torchalpa.save_pretrained(pm, dir)``
        gathers it to rank 0 alone, one tensor at a time."""
        from torchalpa.runtime.state.pretrained_save import gathered_module
        return gathered_module(self)

    def local_program(self) -> str:
        """This rank's forward, backward and gradient-reduction programs as Python code."""
        if isinstance(self.plan, PipelinePlan):
            return f"# stage {self.stage} of {len(self.plan.stages)}\n" + self._program.code()
        return self._program.code()

    def extra_repr(self) -> str:
        micro = f", num_micro_batches={self.num_micro_batches}" if self.num_micro_batches > 1 \
            else ""
        return f"mesh={tuple(self.plan.mesh_shape)}, plan={self.plan.graph_fingerprint}{micro}"
