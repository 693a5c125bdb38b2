"""A torchalpa plan as torch's tensor-parallel plan (``parallelize_module``), where it can be.

``tp_plan(plan, model=None, axis=None)`` maps each module whose parameters the plan
shards over one mesh axis to the ``ParallelStyle`` that places them the same way:

====================  ===============================  ===================
module                plan's layout on the TP axis      style
====================  ===============================  ===================
``nn.Linear``         weight ``S(0)``, bias ``S(0)``    ``ColwiseParallel``
``nn.Linear``         weight ``S(1)``, bias ``R``       ``RowwiseParallel``
``nn.Embedding``      weight ``S(1)``                   ``ColwiseParallel``
``nn.Embedding``      weight ``S(0)``                   ``RowwiseParallel``
====================  ===============================  ===================

Modules whose parameters are all replicated on that axis need no entry (``parallelize_module``
leaves them whole). The styles keep torch's default input/output layouts
(``use_local_output=False`` so that DTensors carry the layouts between modules and any
resharding the plan's activations need happens in DTensor's ops); ``SequenceParallel`` is
not emitted: the plan's parameter layouts cannot tell a sequence-parallel norm from a
replicated one (both hold replicated weights), so norms are left out.

What has no such style is an error naming the parameter: a layout sharded on more than
one mesh axis or on a non-TP axis (ZeRO / FSDP sharding: use ``fully_shard`` for that
axis), a ``Partial`` parameter, a bias sharded differently from its weight, or a sharded
parameter of another module type. Without ``model`` the module types are inferred from
the parameter names: a module holding a 2-D ``weight`` (and maybe a ``bias``) is taken
for an ``nn.Linear`` -- an ``nn.Embedding`` reads the same way, so pass the model when it
has sharded embeddings.
"""

from __future__ import annotations

from torchalpa.core.placement import split_factor_of
from torchalpa.core.plan import register_view

__all__ = ["tp_plan", "NotExpressibleError"]


class NotExpressibleError(ValueError):
    """The plan places some parameter in a way no torch ``ParallelStyle`` does."""


def _axis(plan, axis) -> int:
    from torch.distributed.tensor import Replicate
    if isinstance(axis, str):
        if axis not in plan.axis_names:
            raise ValueError(f"axis {axis!r} is not one of the plan's mesh axes "
                             f"{plan.axis_names}")
        return plan.axis_names.index(axis)
    if axis is not None:
        if not 0 <= axis < len(plan.mesh_shape):
            raise ValueError(f"axis {axis} is out of range for a mesh of shape "
                             f"{plan.mesh_shape}")
        return axis
    sharded_axes = {i for p in plan.parameters for i, pl in enumerate(p.placements)
                    if not isinstance(pl, Replicate)}
    if len(sharded_axes) > 1:
        raise NotExpressibleError(
            f"the plan shards parameters over mesh axes {sorted(sharded_axes)} of "
            f"{plan.mesh_shape}; a tensor-parallel plan covers one: pass axis= (the other "
            "axes' sharding is ZeRO/FSDP: apply fully_shard on them)")
    return sharded_axes.pop() if sharded_axes else len(plan.mesh_shape) - 1


def _module_kind(name: str, model, params: dict) -> str:
    if model is None:
        return "Linear" if params.get("weight") is not None and \
            len(params["weight"].shape) == 2 and set(params) <= {"weight", "bias"} else "?"
    import torch.nn as nn
    module = model.get_submodule(name) if name else model
    if isinstance(module, nn.Linear):
        return "Linear"
    if isinstance(module, nn.Embedding):
        return "Embedding"
    return type(module).__name__


def _short(placement) -> str:
    from torchalpa.core.placement import short_form
    return short_form(placement)


@register_view("tp_plan")
def tp_plan(plan, model=None, axis: int | str | None = None) -> dict:
    """``{module path: ParallelStyle}`` for ``parallelize_module(model, mesh[axis], ...)``
    reproducing ``plan``'s parameter layouts on mesh axis ``axis`` (see the module
    docstring); ``NotExpressibleError`` naming what has no style."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if hasattr(plan, "transfers"):
        raise NotExpressibleError("a pipeline plan has no tensor-parallel equivalent; export "
                                  "each stage's plan")
    tp = _axis(plan, axis)
    by_module: dict[str, dict] = {}
    for p in plan.parameters:
        module, _, leaf = p.name.rpartition(".")
        others = [pl for i, pl in enumerate(p.placements) if i != tp]
        if any(not isinstance(pl, Replicate) for pl in others):
            raise NotExpressibleError(
                f"{p.name} is placed ({', '.join(map(_short, p.placements))}): sharded on a mesh "
                f"axis other than the tensor-parallel axis {tp}; no ParallelStyle does that "
                "(ZeRO/FSDP sharding: fully_shard over that axis)")
        by_module.setdefault(module, {})[leaf] = p
    styles = {}
    for module, params in by_module.items():
        layouts = {leaf: p.placements[tp] for leaf, p in params.items()}
        if all(isinstance(pl, Replicate) for pl in layouts.values()):
            continue
        where = f"module {module!r}" if module else "the top-level module"
        for leaf, pl in layouts.items():
            if split_factor_of(pl) > 1:
                raise NotExpressibleError(f"{params[leaf].name} is {_short(pl)} on axis {tp}: "
                                          "a strided shard (its heads of each of q, k and v) "
                                          "has no ParallelStyle (ColwiseParallel splits "
                                          "contiguous rows)")
            if not isinstance(pl, (Shard, Replicate)):
                raise NotExpressibleError(f"{params[leaf].name} is {_short(pl)} on axis {tp}: "
                                          "a partial parameter has no ParallelStyle")
        kind = _module_kind(module, model, params)
        weight, bias = layouts.get("weight"), layouts.get("bias", None)
        ndim = len(params["weight"].shape) if "weight" in params else 0
        dim = None if not isinstance(weight, Shard) else weight.dim % max(ndim, 1)
        if kind == "Linear" and set(layouts) <= {"weight", "bias"}:
            if dim == 0 and (bias is None or bias == Shard(0)):
                styles[module] = ColwiseParallel(use_local_output=False)
                continue
            if dim == 1 and (bias is None or isinstance(bias, Replicate)):
                styles[module] = RowwiseParallel(use_local_output=False)
                continue
        if kind == "Embedding" and set(layouts) == {"weight"} and dim is not None:
            styles[module] = (ColwiseParallel if dim == 1 else RowwiseParallel)(
                use_local_output=False)
            continue
        given = ", ".join(f"{leaf} {_short(pl)}" for leaf, pl in sorted(layouts.items()))
        raise NotExpressibleError(
            f"{where} ({kind}) is placed {given} on mesh axis {tp}; torch's ParallelStyles "
            "cover nn.Linear (weight S(0) with bias S(0): ColwiseParallel; weight S(1) with "
            "bias R: RowwiseParallel) and nn.Embedding (weight S(1) / S(0)) only")
    return styles
