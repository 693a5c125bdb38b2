"""Ops that split a dim their results depend on entirely, in phases joined by all-reduces.

A log-softmax over a vocabulary split across devices (Megatron's vocab-parallel cross
entropy) needs each row's max and sum of exponentials over the whole vocabulary. Each
device computes them on its block and an all-reduce over the mesh axes that split the dim
completes them; the result is then finished locally, still split:

- ``_log_softmax(x, dim)``: ``m = max(x)`` (all-reduce max), ``s = sum(exp(x - m))``
  (all-reduce sum), ``x - m - log(s)``;
- ``_log_softmax_backward_data(g, y, dim)``: ``s = sum(g)`` (all-reduce sum),
  ``g - exp(y) * s``.

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

__all__ = ["SyncedOp", "SYNCED", "synced_axes", "run_synced"]

aten = torch.ops.aten


@dataclass(frozen=True)
class SyncedOp:
    """Phases of one op on a split dim: ``statistics[k](*args, *stats)`` computes statistic k
    on this block (then all-reduced with ``reduce_ops[k]``), ``finish(*args, *stats)`` the
    result. ``args`` are the op's own positional arguments; ``dim_arg`` is where its dim is."""

    statistics: tuple[Callable[..., torch.Tensor], ...]
    reduce_ops: tuple[str, ...]
    finish: Callable[..., torch.Tensor]
    dim_arg: int


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
}


def synced_axes(node: torch.fx.Node, args, inputs) -> list[int]:
    """The mesh axes that split the synced dim of this call (``inputs``: the placements its
    strategy reads its operands in); empty when the op runs whole along it."""
    spec = SYNCED.get(str(node.target))
    if spec is None:
        return []
    rank = node.meta["val"].dim()
    dim = args[spec.dim_arg]
    dim = dim + rank if dim < 0 else dim
    return [axis for axis, p in enumerate(inputs[0] or ()) if is_shard(p) and p.dim == dim]


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
