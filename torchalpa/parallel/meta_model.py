"""``torchalpa.to_meta(model)``: a model moved to the ``meta`` device with its ties kept.

``Module.to("meta")`` of a model built on a CPU gives every module its own new parameter
(a CPU tensor cannot become a meta tensor in place), so a weight two modules share -- a
GPT's ``wte.weight`` and ``lm_head.weight`` -- becomes two unrelated parameters, and a
plan of the moved model would hold, shard and update two tables. ``to_meta`` moves the
model the same way and then ties again every parameter (and buffer) that was one tensor
before: each module's attribute points at the first owner's new meta tensor.

``torchalpa.plan`` needs no move at all: a CPU model is captured on fake tensors and its
weights are never read; ``to_meta`` is for freeing a CPU model's memory (or matching meta
example inputs) before planning.
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["to_meta"]


def _owners(model: nn.Module, kind: str) -> dict[int, list[tuple[nn.Module, str]]]:
    """``{id(tensor): [(module, attribute name), ...]}`` for parameters or buffers."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, t in getattr(module, kind).items():
            if t is not None:
                owners.setdefault(id(t), []).append((module, name))
    return owners


def to_meta(model: nn.Module) -> nn.Module:
    """Move ``model`` to ``meta`` in place (returns it), keeping shared parameters and
    buffers shared."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"to_meta takes an nn.Module, got {type(model).__name__}")
    shared = {kind: [o for o in _owners(model, kind).values() if len(o) > 1]
              for kind in ("_parameters", "_buffers")}
    model.to("meta")
    for kind, groups in shared.items():
        for (first, first_name), *others in groups:
            tensor = getattr(first, kind)[first_name]
            for module, name in others:
                getattr(module, kind)[name] = tensor
    return model
