"""Ops that split a dim their results depend on entirely, in phases joined by all-reduces.

A log-softmax over a vocabulary split across devices (Megatron's vocab-parallel cross
entropy) needs each row's max and sum of exponentials over the whole vocabulary. Each
device computes them on its block and an all-reduce over the mesh axes that split the dim
completes them; the result is then finished locally, still split:

- ``_log_softmax(x, dim)``: ``m = max(x)`` (all-reduce max), ``s = sum(exp(x - m))``
  (all-reduce sum), ``x - m - log(s)``;
- ``_log_softmax_backward_data(g, y, dim)``: ``s = sum(g)`` (all-reduce sum),
  ``g - exp(y) * s``;
- ``torchalpa::cross_entropy(logits, targets, ignore_index, eps)`` over a split vocabulary
  (dim 1): ``m = max(x)`` (all-reduce max), ``s = sum(exp(x - m))`` (all-reduce sum),
  ``l = (1 - eps) x_t + eps sum(x) / V`` with ``x_t`` 0 where another block owns the
  target (all-reduce sum); ``lse = m + log(s)``, ``loss = lse - l``, whole on every rank
  of the split (``ops/cross_entropy.py``'s ``block_*``). Its phases address columns, so
  they also take this rank's block of the dim (``block_args``: its first column and the
  dim's whole size). Its backward needs no statistic: ``runtime.lowering.localize`` runs it
  on the block.

The planner's rule (``passes/rules/softmax.py``, its ``synced`` factor) lists the same
statistics and reduce ops, and prices their all-reduces; ``runtime.lowering.lower`` emits each phase
as a call and each all-reduce as ``runtime.execution.collectives.all_reduce`` between them, so the
local program stays plain ops plus collective calls, and the collectives it issues are the
plan's. Statistics keep the reduced dim (size 1) and are computed in the input's dtype, as
the fused kernels do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchalpa.core.placement import is_shard
from torchalpa.ops import cross_entropy as CE
from torchalpa.runtime.lowering.vocab import row_offset

__all__ = ["SyncedOp", "SYNCED", "synced_axes", "block_args", "run_synced"]

aten = torch.ops.aten


@dataclass(frozen=True)
class SyncedOp:
    """Phases of one op on a split dim: ``statistics[k](*args, *stats)`` computes statistic k
    on this block (then all-reduced with ``reduce_ops[k]``), ``finish(*args, *stats)`` the
    result. ``args`` are the op's own positional arguments; ``dim_arg`` is where its dim is
    (None: ``dim``, of the first operand, always). ``block``: the phases take this rank's
    (first position, whole size) of the dim after ``args`` (``block_args``)."""

    statistics: tuple[Callable[..., torch.Tensor], ...]
    reduce_ops: tuple[str, ...]
    finish: Callable[..., Any]
    dim_arg: int | None
    dim: int = 0
    block: bool = False


def log_softmax_max(x, dim, half_to_float):
    return (x.float() if half_to_float else x).amax(dim, keepdim=True)


def log_softmax_sum_exp(x, dim, half_to_float, m):
    return torch.exp((x.float() if half_to_float else x) - m).sum(dim, keepdim=True)


def log_softmax_finish(x, dim, half_to_float, m, s):
    return (x.float() if half_to_float else x) - m - torch.log(s)


def log_softmax_backward_sum(grad, output, dim, input_dtype):
    return grad.sum(dim, keepdim=True)


def log_softmax_backward_finish(grad, output, dim, input_dtype, s):
    return (grad - torch.exp(output) * s).to(input_dtype)


SYNCED: dict[str, SyncedOp] = {
    "aten._log_softmax.default": SyncedOp(
        statistics=(log_softmax_max, log_softmax_sum_exp), reduce_ops=("max", "sum"),
        finish=log_softmax_finish, dim_arg=1),
    "aten._log_softmax_backward_data.default": SyncedOp(
        statistics=(log_softmax_backward_sum,), reduce_ops=("sum",),
        finish=log_softmax_backward_finish, dim_arg=2),
    "torchalpa.cross_entropy.default": SyncedOp(
        statistics=(CE.block_max, CE.block_sum_exp, CE.block_linear),
        reduce_ops=("max", "sum", "sum"), finish=CE.block_finish, dim_arg=None, dim=1,
        block=True),
}


def synced_axes(node: torch.fx.Node, args, inputs) -> list[int]:
    """The mesh axes that split the synced dim of this call (``inputs``: the placements its
    strategy reads its operands in); empty when the op runs whole along it."""
    spec = SYNCED.get(str(node.target))
    if spec is None:
        return []
    dim = _dim(spec, node, args)
    return [axis for axis, p in enumerate(inputs[0] or ()) if is_shard(p) and p.dim == dim]


def _dim(spec: SyncedOp, node: torch.fx.Node, args) -> int:
    """The synced dim of the op's first operand, counted from 0."""
    if spec.dim_arg is None:
        return spec.dim
    source = node.args[0]
    assert isinstance(source, torch.fx.Node)
    rank = source.meta["val"].dim()
    dim = args[spec.dim_arg]
    return dim + rank if dim < 0 else dim


def block_args(node: torch.fx.Node, args, inputs, mesh_shape, coords) -> tuple:
    """``args`` of a synced call as its phases take them: with the rank at ``coords``'s
    (first position, whole size) of the synced dim after them where the op's phases
    address positions along it (``SyncedOp.block``)."""
    spec = SYNCED[str(node.target)]
    if not spec.block:
        return tuple(args)
    source = node.args[0]
    assert isinstance(source, torch.fx.Node)
    size = source.meta["val"].shape[_dim(spec, node, args)]
    offset, _ = row_offset(size, _dim(spec, node, args), inputs[0], mesh_shape, coords)
    return (*args, offset, size)


def _eager(fn: Callable, args: tuple):
    return fn(*args)


def run_synced(target: str, args, axes, all_reduce: Callable[[Any, str, int], Any],
               call: Callable[[Callable, tuple], Any] = _eager):
    """The phases of ``target`` on this block, ``all_reduce(stat, op, axis)`` joining them
    (over each axis in ``axes``); ``call(fn, args)`` runs a phase. ``runtime.lowering.lower`` passes
    functions that emit graph calls; the rule harness runs phases eagerly and sums or maxes
    the blocks of simulated ranks."""
    spec = SYNCED[target]
    stats: list = []
    for compute, op in zip(spec.statistics, spec.reduce_ops):
        stat = call(compute, (*args, *stats))
        for axis in axes:
            stat = all_reduce(stat, op, axis)
        stats.append(stat)
    return call(spec.finish, (*args, *stats))
