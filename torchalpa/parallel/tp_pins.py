"""``pin=`` in torch's tensor-parallel vocabulary: ``{"layers.*.attn.wq": ColwiseParallel()}``.

A ``ParallelStyle`` says how ``parallelize_module`` lays out one module's parameters on
the tensor-parallel mesh axis; here it becomes the pins that hold those parameters in the
same layout, and the planner chooses everything else (the other mesh axes, activations,
the collectives between). A style pins the **last** mesh axis (torch's and torchtitan's
``("dp", "tp")`` convention; on a 1D mesh, the only one) and leaves the leading axes to
the ILP (the pin starts with ``"..."``):

====================  ==================  ===============================================
style                 module              its parameters on the tensor-parallel axis
====================  ==================  ===============================================
``ColwiseParallel``   ``nn.Linear``       weight ``S(0)``, bias ``S(0)``
``RowwiseParallel``   ``nn.Linear``       weight ``S(1)``, bias ``R``
``ColwiseParallel``   ``nn.Embedding``    weight ``S(1)``
``RowwiseParallel``   ``nn.Embedding``    weight ``S(0)``
``SequenceParallel``  a norm              weight and bias ``R`` (the sequence split of its
                                          activations is the planner's choice)
====================  ==================  ===============================================

This is the inverse of ``plan.to_tp_plan()`` (``torchalpa/interop/tp_plan.py``). Keys are module
paths as ``parallelize_module`` takes them: split at dots, each part a glob over one
level (``layers.*.attention.wq``). A style's activation layouts (``input_layouts``,
``output_layouts``, ``use_local_output``) say how a module talks to its neighbours, which
the planner decides here: a non-default one draws a warning saying it is not followed.
What has no meaning for a parameter layout is an error naming the module: a style on a
module type outside the table (``SequenceParallel`` on a ``Linear``, ``ColwiseParallel``
on a ``Conv2d``), ``PrepareModuleInput``/``Output`` (activations only), or a key no
module matches.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import re
import warnings

import torch.nn as nn

from torchalpa.core.options import is_style

__all__ = ["has_style_pins", "style_pins", "resolve_style_pins"]

# module types whose parameters SequenceParallel keeps whole (torch applies it to norms)
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase,
          *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))




def has_style_pins(pin) -> bool:
    return any(is_style(value) for _, value in pin)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORMS) or type(module).__name__.endswith(("Norm", "RMSNorm"))


def _layouts(style, path: str, module: nn.Module) -> dict[str, str]:
    """``{parameter leaf: placement}`` the style gives ``module`` on the TP axis."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    name = type(style).__name__
    kind = type(module).__name__
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        colwise = isinstance(style, ColwiseParallel)
        if isinstance(module, nn.Linear):
            return {"weight": "S(0)", "bias": "S(0)"} if colwise else \
                {"weight": "S(1)", "bias": "R"}
        if isinstance(module, nn.Embedding):
            return {"weight": "S(1)" if colwise else "S(0)"}
        raise ValueError(f"pin: {name} on {path!r} ({kind}) has no meaning here: torch applies "
                         f"it to nn.Linear and nn.Embedding only; pin {path}'s parameters with "
                         "placements instead, e.g. {'" + re.escape(path) + "[.]weight': "
                         "('...', 'S(0)')}")
    if isinstance(style, SequenceParallel):
        if not _is_norm(module):
            raise ValueError(f"pin: SequenceParallel on {path!r} ({kind}) has no meaning here: "
                             "it keeps a norm's parameters whole while its activations are split "
                             "along the sequence, and is applied to norm layers (LayerNorm, "
                             "RMSNorm); for a Linear use ColwiseParallel / RowwiseParallel")
        return {leaf: "R" for leaf, _ in module.named_parameters(recurse=False)}
    raise ValueError(f"pin: {name} on {path!r} only changes the layouts of a module's inputs or "
                     "outputs, which the planner chooses; it pins no parameter. Leave it out "
                     "(or pin the parameters with placements)")


def _warn_on_activation_layouts(style, path: str) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    defaults = {ColwiseParallel: ((Replicate(),), (Shard(-1),)),
                RowwiseParallel: ((Shard(-1),), (Replicate(),))}.get(type(style))
    if defaults is None:
        return
    given = (tuple(style.input_layouts), tuple(style.output_layouts))
    if given != defaults:
        warnings.warn(f"pin: {type(style).__name__}(input_layouts={given[0]}, output_layouts="
                      f"{given[1]}) on {path!r}: only its parameter layouts are pinned; the "
                      "layouts of activations between modules are the planner's choice",
                      stacklevel=4)


def _matches(pattern: str, path: str) -> bool:
    """``parallelize_module``'s rule: the same number of dotted parts, each a glob."""
    atoms, parts = pattern.split("."), path.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a)
                                            for a, p in zip(atoms, parts))


def style_pins(pin, model: nn.Module) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``pin`` with each ``(module glob, ParallelStyle)`` entry replaced by one pin per
    parameter of each module it matches (an exact name, ``("...", placement)``); other
    entries unchanged, in order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"pin: tensor-parallel styles need an nn.Module to read module types "
                        f"from, got {type(model).__name__}; pin placements instead")
    modules = dict(model.named_modules())
    out: list[tuple[str, tuple[str, ...]]] = []
    for pattern, value in pin:
        if not is_style(value):
            out.append((pattern, value))
            continue
        matched = [path for path in modules if path and _matches(pattern, path)]
        if not matched:
            close = difflib.get_close_matches(pattern, [p for p in modules if p], n=3)
            raise ValueError(f"pin: {type(value).__name__} on {pattern!r} matches no module of "
                             f"{type(model).__name__} (keys are module paths with one glob per "
                             "dotted part, as parallelize_module takes them)"
                             + (f"; close: {', '.join(close)}" if close else ""))
        _warn_on_activation_layouts(value, pattern)
        for path in matched:
            module = modules[path]
            for leaf, placement in _layouts(value, path, module).items():
                if getattr(module, leaf, None) is not None:
                    out.append((re.escape(f"{path}.{leaf}"), ("...", placement)))
    return tuple(out)


def resolve_style_pins(method, model):
    """``method`` with the tensor-parallel styles of its pins (``auto_sharding_option`` and
    ``manual_sharding_option``) translated for ``model``; ``method`` itself when it has none."""
    option = method.auto_sharding_option
    manual = getattr(method, "manual_sharding_option", None)
    changes = {}
    if has_style_pins(option.pin):
        changes["auto_sharding_option"] = dataclasses.replace(
            option, pin=style_pins(option.pin, model))
    if manual is not None and has_style_pins(manual.pin):
        changes["manual_sharding_option"] = dataclasses.replace(
            manual, pin=style_pins(manual.pin, model))
    return dataclasses.replace(method, **changes) if changes else method
