"""How a model is called: positional tensors, or keywords as HuggingFace models are.

Trainer and Accelerate call a model as ``model(**batch)``, e.g.
``model(input_ids=ids, attention_mask=mask, labels=labels)``, and positional calls bind
by position (three tensors given to an HF causal LM land in ``input_ids``,
``attention_mask`` and ``position_ids``, not ``labels``). So ``example_inputs`` may be a
dict of keyword arguments: its tensors become the step's inputs (named by their keys, in
the dict's order) and its other values (``use_cache=False``, ``return_dict=True``) are
fixed for every call. ``CallSignature`` records that, calls the model that way during
capture, and turns a later call's ``(*args, **kwargs)`` back into the tensor list the
programs take.

The loss of a keyword call is the model's own (``outputs["loss"]``, HuggingFace computes
it from ``labels``), or ``loss_fn(outputs)`` when given: a dict holds model inputs only.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CallSignature", "positional_binding", "record_output_type"]


@dataclass(frozen=True)
class CallSignature:
    """``num_positional`` tensors by position, then one tensor per name in ``keywords``,
    plus ``static`` keyword values fixed at capture."""

    num_positional: int
    keywords: tuple[str, ...] = ()
    static: tuple[tuple[str, Any], ...] = ()
    output_type: list = field(default_factory=list, compare=False)  # set during capture

    @staticmethod
    def of(example_inputs) -> tuple[CallSignature, tuple[torch.Tensor, ...]]:
        """The signature and the tensors of ``example_inputs`` (a sequence or a dict)."""
        if isinstance(example_inputs, Mapping):
            keys = [k for k, v in example_inputs.items() if isinstance(v, torch.Tensor)]
            for k in example_inputs:
                if not isinstance(k, str):
                    raise TypeError(f"example_inputs keys must be argument names, got {k!r}")
            static = tuple((k, v) for k, v in example_inputs.items()
                           if not isinstance(v, torch.Tensor))
            if not keys:
                raise TypeError("example_inputs is a dict without tensors; give the model's "
                                "tensor arguments by name, e.g. {'input_ids': ids, 'labels': ids}")
            return (CallSignature(0, tuple(keys), static),
                    tuple(example_inputs[k] for k in keys))
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        if not isinstance(example_inputs, Sequence):
            raise TypeError(f"example_inputs must be a tuple of tensors or a dict of keyword "
                            f"arguments, got {type(example_inputs).__name__}")
        return CallSignature(len(example_inputs)), tuple(example_inputs)

    @property
    def by_keyword(self) -> bool:
        return bool(self.keywords) or bool(self.static)

    def names(self, num_tensors: int) -> list[str]:
        """A name per tensor: ``input{i}`` by position, the keyword for keywords."""
        return [f"input{i}" for i in range(num_tensors - len(self.keywords))] + \
            list(self.keywords)

    def call(self, model: Callable, tensors: Sequence[torch.Tensor]):
        """``model`` called with ``tensors`` the way the example inputs were given."""
        cut = len(tensors) - len(self.keywords)
        kwargs = dict(zip(self.keywords, tensors[cut:]))
        return model(*tensors[:cut], **kwargs, **dict(self.static))

    def flatten(self, args: Sequence, kwargs: Mapping) -> list:
        """A later call's arguments as the tensor list the programs take."""
        if not self.by_keyword:
            if kwargs:
                raise TypeError(
                    f"this model was captured with positional example inputs, got keyword "
                    f"arguments {sorted(kwargs)}; pass example_inputs as a dict "
                    "(auto_parallel(model, {'input_ids': ids, ...})) to call it by keyword")
            return list(args)
        if args:
            raise TypeError(f"this model was captured with keyword example inputs "
                            f"{list(self.keywords)}; call it the same way, e.g. "
                            f"pmodel({', '.join(f'{k}=...' for k in self.keywords)})")
        missing = [k for k in self.keywords if k not in kwargs]
        extra = [k for k in kwargs if k not in self.keywords and k not in dict(self.static)]
        if missing or extra:
            raise TypeError(f"expected the keyword tensors {list(self.keywords)} given at "
                            f"capture; missing {missing}, unexpected {extra}")
        for k, v in self.static:
            if k in kwargs and kwargs[k] != v:
                raise ValueError(f"{k}={kwargs[k]!r} differs from {k}={v!r} the step was "
                                 "captured with; capture again with the new value")
        return [kwargs[k] for k in self.keywords]

    def wrap_loss(self, loss: torch.Tensor):
        """The loss in the type the model's forward returned (a ModelOutput or a dict with
        ``loss`` set, its other fields not computed), or the loss itself."""
        kind = self.output_type[0] if self.output_type else None
        if kind is None:
            return loss
        try:
            return kind(loss=loss)
        except TypeError:
            return loss


def record_output_type(signature: CallSignature, out) -> None:
    """Remember the forward's output type if it holds the loss by name (``out["loss"]``)."""
    signature.output_type.clear()
    if (isinstance(out, Mapping) and "loss" in out) or (
            dataclasses.is_dataclass(out) and hasattr(out, "loss")):
        signature.output_type.append(type(out))     # a ModelOutput, a dict, a dataclass


def positional_binding(model: torch.nn.Module, num_inputs: int) -> str:
    """How ``num_inputs`` positional tensors bind to ``model.forward``'s parameters."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return ""
    if len(params) < num_inputs:
        return ""
    return ", ".join(f"example_inputs[{i}] -> {name}" for i, name in enumerate(params[:num_inputs]))
