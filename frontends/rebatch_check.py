"""Whether a derived micro-batch step is the traced one, from two records instead of a trace.

``MicroBatchSteps`` trusts a derivation (``rebatched_capture``) once it gave the step a
trace gives; that second trace cost target e (LLaMA-3-70B, 80 layers) as much as the
first. ``RecordCheck`` instead records the step's ops at two batch sizes
(``torch_export.record_step``: the capture's joint function run on ``meta`` tensors, a
tenth of a trace) and vouches for the derivation when the records show that nothing the
derivation keeps depends on the batch:

- the two records run the same ops in the same order (no Python branch on the batch);
- every op of the captured graph is one of the ops recorded at the whole batch, in order,
  with the same arguments and shapes (``RecordedOp``): an op made after the trace
  (a constant inlined, functionalization's rewrites) or traced otherwise is not, and the
  records cannot vouch for it;
- at each such op, the record at the smaller batch has the same arguments, tensors'
  shapes aside, except a view's and an expand's sizes, which must be the ones the
  derivation gives them (``view_rescaled``, ``expand_rescaled``) from the shapes recorded.

Anything else -- a number Python computed from the batch (``loss / (x.shape[0] * 3)``),
``mse_loss``'s ``2 / numel``, a ``zeros(x.shape[0])`` -- differs between the records at
an op of the graph, and the check gives the reason it cannot vouch; ``MicroBatchSteps``
then checks with a trace, as before. As with the trace, a number that takes the same
value at both batch sizes is taken not to depend on the batch.

What the records assume beyond the trace's check: the graph's ops are matched to the
recorded ones in order, each to the first later record alike at the whole batch (same op,
arguments and shapes); two such ops that differ only in where the batch runs in them, one
recorded and dropped before the graph was made, could be mistaken for each other. And a
model whose Python does other work when traced than when run (``is_fx_tracing()``) is
checked on the run, not the trace (its graph's ops then differ from the records, mostly,
and the trace checks it).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx

from torchalpa.frontends.op_record import RecordedOp, op_args
from torchalpa.frontends.rebatch import CannotRebatch, expand_rescaled, view_rescaled
from torchalpa.frontends.torch_export import Capture

__all__ = ["RecordCheck", "records_vouch"]

log = logging.getLogger("torchalpa.capture")

_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                    torch.ops.aten.reshape.default})
_EXPAND = torch.ops.aten.expand.default


class RecordCheck:
    """``check(captured, base, k)``: None where the records of ``base`` and ``k``
    micro-batches vouch that ``captured`` (the step at ``base``) derived at ``k`` is the
    traced step, else why not. ``record(k)``: the ops of the step at ``k`` micro-batches
    (``torch_export.record_step``); each count is recorded once."""

    def __init__(self, record: Callable[[int], Sequence[RecordedOp]]):
        self.record = record
        self.records: dict[int, Sequence[RecordedOp] | str] = {}

    def _recorded(self, k: int) -> Sequence[RecordedOp] | str:
        if k not in self.records:
            try:
                self.records[k] = self.record(k)
            except Exception as e:   # the step does not run eagerly on meta: no vouching
                self.records[k] = f"recording {k} micro-batches failed: " \
                                  f"{type(e).__name__}: {str(e)[:200]}"
        return self.records[k]

    def __call__(self, captured: Capture, base: int, k: int) -> str | None:
        whole, part = self._recorded(base), self._recorded(k)
        if isinstance(whole, str):
            return whole
        if isinstance(part, str):
            return part
        return records_vouch(captured, whole, part)


def records_vouch(captured: Capture, whole: Sequence[RecordedOp],
                  part: Sequence[RecordedOp]) -> str | None:
    """None where ``whole`` and ``part`` (the step's records at the captured batch and at
    a smaller one) vouch that the derivation of ``captured`` gives the traced step; else
    the first reason they do not."""
    if len(whole) != len(part) or any(a.target != b.target for a, b in zip(whole, part)):
        return "the step runs other ops at the smaller batch"
    i = 0
    for n in captured.gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        key = _recorded(n)
        while i < len(whole) and whole[i] != key:
            i += 1
        if i == len(whole):
            return f"{n.name} ({n.target}) is not among the ops recorded"
        reason = _same_numbers(n.name, whole[i], part[i])
        if reason:
            return reason
        i += 1
    return None


def _recorded(n: fx.Node) -> RecordedOp:
    """The graph's node as ``record_ops`` records an op."""
    return RecordedOp(n.target, op_args((n.args, n.kwargs), _node_shape),
                      op_args(n.meta.get("val"), _value_shape))


def _node_shape(a) -> tuple | None:
    if isinstance(a, fx.Node):
        return _value_shape(a.meta.get("val"))
    return _value_shape(a)


def _value_shape(a) -> tuple | None:
    return tuple(a.shape) if isinstance(a, torch.Tensor) else None


def _same_numbers(name: str, whole: RecordedOp, part: RecordedOp) -> str | None:
    """Why the op's arguments at the smaller batch are not the derivation's, or None."""
    if whole.target in _VIEWS or whole.target is _EXPAND:
        (_, a), (_, b) = whole.args[0], part.args[0]
        rank = len(whole.out[0][1])
        sizes = list(whole.args[1:1 + rank])
        try:
            if whole.target is _EXPAND:
                want = expand_rescaled(name, sizes, a, b, None)
            else:
                want = view_rescaled(name, sizes, a, b, whole.out[0][1], False)[0]
        except CannotRebatch as e:
            return str(e)
        if list(part.args[1:1 + rank]) != want or whole.args[1 + rank:] != part.args[1 + rank:]:
            return f"{name} ({whole.target}) is given {list(part.args[1:1 + rank])} at the " \
                   f"smaller batch, not {want}"
        return None
    if len(whole.args) != len(part.args):
        return f"{name} ({whole.target}) is given other arguments at the smaller batch"
    for x, y in zip(whole.args, part.args):
        tensors = isinstance(x, tuple) and x[:1] == ("tensor",)
        if tensors != (isinstance(y, tuple) and y[:1] == ("tensor",)) or \
                (not tensors and not _same(x, y)):
            return f"{name} ({whole.target}) is given {y} at the smaller batch, {x} at the " \
                   "whole: a number from the batch"
    return None


def _same(x, y) -> bool:
    return type(x) is type(y) and x == y
