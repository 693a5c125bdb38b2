"""Synchronized batch norm: training batch norm over a batch split across devices.

``passes/rules/norm.py`` lets the planner split a training batch norm's batch (and
spatial) dims when the devices splitting them synchronize their statistics. This module
runs those ops on a rank's block so that every rank normalizes with the statistics of the
whole batch, as one device would:

- forward: each rank sums ``x`` and ``x^2`` per channel over its block, one all-reduce of
  the (2, C) sums over every mesh axis that splits the batch gives the global sums, and
  the mean, biased variance and ``rstd = 1 / sqrt(var + eps)`` follow from the global
  element count; running statistics use the unbiased variance of the whole batch, as
  PyTorch's ``BatchNorm`` does;
- backward: each rank sums ``dy`` and ``dy * x_hat`` per channel, one all-reduce gives the
  global sums, and ``grad_input = w * rstd * (dy - sum dy / N - x_hat * sum(dy x_hat) / N)``;
  the two sums are the bias and weight gradients, whole on every rank.

Sums are taken in float32 for half-precision inputs (float64 stays float64); the
all-reduces are ``runtime.execution.collectives.all_reduce`` calls, counted like every other
collective, and their (axis, bytes) are the plan's ``NodeStrategy.batch_syncs``. (A
softmax over a split vocabulary, which needs phases joined by several all-reduces, is
``runtime.lowering.synced``'s job.)

Each op is two local halves around the all-reduce: ``sums`` (this rank's per-channel sums,
a (2, C) tensor) and ``finish`` (the results from the global sums), listed in ``SYNCED``
so the rule harness can check them on simulated ranks. ``runtime.lowering.lower`` replaces a
batch-synced op's local call with ``synced_call(...)``, a call of ``run``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from torchalpa.runtime.execution import collectives as C

__all__ = ["SYNCED", "Synced", "synced_call", "run", "per_channel_count"]

aten = torch.ops.aten


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _reduced_dims(x: torch.Tensor) -> list[int]:
    return [d for d in range(x.dim()) if d != 1]


def _channel_view(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A (C,) tensor shaped to broadcast against ``x`` (N, C, ...)."""
    return t.view([1, -1] + [1] * (x.dim() - 2))


def _x_sums(x, *_):
    """Per channel: (sum x, sum x^2) over this rank's block, in the acc dtype."""
    xa = x.to(_acc_dtype(x))
    dims = _reduced_dims(x)
    return torch.stack([xa.sum(dims), (xa * xa).sum(dims)])


def _statistics(sums: torch.Tensor, count: int, eps: float):
    """(mean, biased variance, rstd) per channel from the global sums."""
    mean = sums[0] / count
    var = (sums[1] / count - mean * mean).clamp_min(0)
    return mean, var, torch.rsqrt(var + eps)


def _normalize(x, weight, bias, mean, rstd):
    xa = x.to(mean.dtype)
    out = (xa - _channel_view(mean, x)) * _channel_view(rstd, x)
    if weight is not None:
        out = out * _channel_view(weight.to(mean.dtype), x)
    if bias is not None:
        out = out + _channel_view(bias.to(mean.dtype), x)
    return out.to(x.dtype)


def _forward_finish(sums, x, weight, bias, running_mean, running_var, training, momentum, eps,
                    *, count: int):
    """``aten._native_batch_norm_legit_functional``'s results: (out, save_mean, save_rstd,
    new_running_mean, new_running_var); running statistics take the unbiased variance."""
    assert training, "only training batch norm is synchronized"
    mean, var, rstd = _statistics(sums, count, eps)
    out = _normalize(x, weight, bias, mean, rstd)
    unbiased = var * (count / max(count - 1, 1))
    new_mean = running_mean * (1 - momentum) + mean.to(running_mean.dtype) * momentum
    new_var = running_var * (1 - momentum) + unbiased.to(running_var.dtype) * momentum
    return out, mean.to(x.dtype), rstd.to(x.dtype), new_mean, new_var


def _no_stats_finish(sums, x, weight, bias, training, momentum, eps, *, count: int):
    """``aten._native_batch_norm_legit.no_stats``'s results: (out, save_mean, save_rstd)."""
    assert training, "only training batch norm is synchronized"
    mean, _, rstd = _statistics(sums, count, eps)
    return _normalize(x, weight, bias, mean, rstd), mean.to(x.dtype), rstd.to(x.dtype)


def _x_hat(x, save_mean, save_invstd):
    acc = _acc_dtype(x)
    return ((x.to(acc) - _channel_view(save_mean.to(acc), x))
            * _channel_view(save_invstd.to(acc), x))


def _grad_sums(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, *_):
    """Per channel: (sum dy, sum dy * x_hat) over this rank's block."""
    dy = grad_out.to(_acc_dtype(x))
    dims = _reduced_dims(x)
    return torch.stack([dy.sum(dims), (dy * _x_hat(x, save_mean, save_invstd)).sum(dims)])


def _backward_finish(sums, grad_out, x, weight, running_mean, running_var, save_mean,
                     save_invstd, train, eps, output_mask, *, count: int):
    """``aten.native_batch_norm_backward``'s results in training mode: (grad_input,
    grad_weight, grad_bias), the last two whole (None where ``output_mask`` says)."""
    assert train, "only training batch norm is synchronized"
    acc = _acc_dtype(x)
    sum_dy, sum_dy_xhat = sums[0], sums[1]
    grad_input = None
    if output_mask[0]:
        rstd = save_invstd.to(acc)
        scale = rstd if weight is None else rstd * weight.to(acc)
        mean_dy = _channel_view(sum_dy / count, x)
        mean_dy_xhat = _channel_view(sum_dy_xhat / count, x)
        x_hat = _x_hat(x, save_mean, save_invstd)
        grad_input = (_channel_view(scale, x) * (grad_out.to(acc) - mean_dy
                                                 - x_hat * mean_dy_xhat)).to(x.dtype)
    param_dtype = x.dtype if weight is None else weight.dtype
    grad_weight = sum_dy_xhat.to(param_dtype) if output_mask[1] else None
    grad_bias = sum_dy.to(param_dtype) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias


class Synced(NamedTuple):
    """A synchronized op: its argument names, the local sums, and the results from the
    global sums."""

    names: tuple[str, ...]
    sums: Callable[..., torch.Tensor]
    finish: Callable[..., tuple]


_FORWARD = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum",
            "eps")
SYNCED: dict[str, Synced] = {
    "aten._native_batch_norm_legit_functional.default": Synced(
        _FORWARD, _x_sums, _forward_finish),
    "aten._native_batch_norm_legit.no_stats": Synced(
        ("input", "weight", "bias", "training", "momentum", "eps"), _x_sums, _no_stats_finish),
    "aten.native_batch_norm_backward.default": Synced(
        ("grad_out", "input", "weight", "running_mean", "running_var", "save_mean",
         "save_invstd", "train", "eps", "output_mask"), _grad_sums, _backward_finish),
}


def run(*args, op: str, count: int, groups: Sequence[str]):
    """Run the batch norm ``op`` on this rank's block: local sums, one all-reduce per
    process group that splits the batch, results from the global sums."""
    synced = SYNCED[op]
    sums = synced.sums(*args)
    for group in groups:
        sums = C.all_reduce(sums, "sum", group)
    return synced.finish(sums, *args, count=count)


def per_channel_count(input_shape: Sequence[int]) -> int:
    """Elements per channel in an (N, C, ...) input: what the statistics average over."""
    return math.prod(int(size) for d, size in enumerate(input_shape) if d != 1)


def synced_call(op: str, args: Sequence, kwargs: dict, *, input_shape: Sequence[int],
                groups: Sequence[str]):
    """(function, args, kwargs) running the batch norm ``op`` synchronized over the process
    ``groups`` (one per mesh axis splitting the batch); ``input_shape`` is the global shape
    of its (N, C, ...) input."""
    synced = SYNCED.get(op)
    if synced is None:
        raise NotImplementedError(f"{op} has no synchronized version; the planner splits the "
                                  f"batch of training batch norm only for {sorted(SYNCED)}")
    count = per_channel_count(input_shape)
    names = synced.names
    values = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    if len(values) != len(names):
        raise ValueError(f"{op} called with {len(values)} of its {len(names)} arguments "
                         f"({', '.join(names)})")
    return run, values, {"op": op, "count": int(count), "groups": tuple(groups)}
