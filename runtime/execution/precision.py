"""Mixed precision: float32 master parameters, forward and backward in bfloat16 / float16.

In the spirit of FSDP2's ``MixedPrecisionPolicy``: the parameters the optimizer sees
(DTensors) stay in float32; the model computes with copies cast to ``param_dtype``;
gradients come back in float32 (the cast's backward casts them up). No frontend change is
needed: ``CastForward`` wraps the model so that its forward casts the parameters
(``functional_call`` with cast copies), and that wrapper is what torchalpa captures, so
the casts are ops of the training step and the planner sees (and prices) the narrow
activations and their collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.utils._pytree import tree_map

__all__ = ["MixedPrecision", "CastForward"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedPrecision:
    """What to compute in and what to keep in float32."""

    param_dtype: torch.dtype = torch.bfloat16
    """Dtype of the parameter copies forward and backward compute with."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype of the parameter gradients: accumulated over micro-batches, brought to their
    parameters' layouts at the end of backward, and handed to the optimizer. Only float32
    is supported (the gradient of a float32 master parameter). Where a partial gradient is
    summed across ranks inside backward -- before the cast up, in ``param_dtype``, or
    after it -- is the planner's choice, priced like any other collective."""
    output_dtype: torch.dtype | None = torch.float32
    """Floating outputs of the model are cast to this before the loss (None: left in
    ``param_dtype``). float32 keeps the loss and its reduction in float32."""
    cast_forward_inputs: bool = True
    """Cast floating model inputs to ``param_dtype`` (integer inputs such as token ids are
    never cast)."""

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is None and name == "output_dtype":
                continue
            if value not in _FLOATS:
                raise TypeError(f"MixedPrecision.{name} must be a floating torch.dtype such as "
                                f"torch.bfloat16, got {value!r}")
        if self.reduce_dtype != torch.float32:
            raise ValueError(f"MixedPrecision.reduce_dtype must be torch.float32 (the dtype of "
                             f"the master parameters' gradients), got {self.reduce_dtype}")


def _cast(dtype: torch.dtype):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x
    return cast


class CastForward(nn.Module):
    """``model`` computing in ``policy.param_dtype``, with the same parameter names.

    Batch-norm layers keep their float32 weight and bias beside their float32 running
    statistics, as FSDP's mixed precision does: batch norm takes a low-precision input with
    float32 parameters, but not low-precision parameters with float32 statistics.

    The wrapper shares the model's submodules, parameters and buffers (the same dicts), so
    ``named_parameters()`` and state dicts read exactly as the model's, and replacing a
    parameter in one replaces it in the other.
    """

    def __init__(self, model: nn.Module, policy: MixedPrecision):
        super().__init__()
        if not isinstance(policy, MixedPrecision):
            raise TypeError(f"mixed_precision must be a torchalpa.MixedPrecision, "
                            f"got {type(policy).__name__}")
        self.__dict__["_modules"] = model._modules
        self.__dict__["_parameters"] = model._parameters
        self.__dict__["_buffers"] = model._buffers
        self.__dict__["wrapped"] = model
        self.policy = policy
        self.kept_float32: frozenset[str] = frozenset(
            f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm)
            for name, _ in module.named_parameters(recurse=False))

    def forward(self, *args, **kwargs):
        policy = self.policy
        if policy.cast_forward_inputs:
            args, kwargs = tree_map(_cast(policy.param_dtype), (args, kwargs))
        down = _cast(policy.param_dtype)
        model: nn.Module = self.__dict__["wrapped"]
        state = {name: p if name in self.kept_float32 else down(p)
                 for name, p in model.named_parameters()}
        out = functional_call(model, state, args, kwargs, strict=False)
        if policy.output_dtype is not None:
            out = tree_map(_cast(policy.output_dtype), out)
        return out
