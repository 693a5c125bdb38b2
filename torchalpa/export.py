"""``export_stablehlo``: a torch training step (forward, loss and backward) as StableHLO.

The step is exported with ``torch.export`` and its joint forward+backward graph
(``_export_forward_backward``) is lowered by torch-mlir
(``torch_mlir.fx.stateless_fx_import(..., output_type="stablehlo")``). ``@main`` takes the
trainable parameters, the buffers, then the example inputs (model inputs, then targets)
and returns ``(loss, *grads)`` in parameter order: the convention
``frontends/stablehlo.py`` reads, so ``torchalpa.plan(export_stablehlo(...), ())``
plans it. Each argument carries ``torchalpa.kind`` (param, buffer, input) and
``torchalpa.name`` (the parameter's FQN); with ``plan=`` the parameters and inputs also
carry ``mhlo.sharding`` annotations (GSPMD's HLO sharding strings, devices in the plan's
mesh order), which XLA honours when it compiles the program for the plan's mesh.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from torchalpa.placement import Partial, Shard
from torchalpa.plan import Plan

__all__ = ["export_stablehlo", "hlo_sharding"]


class _StepWithLoss(torch.nn.Module):
    """``model`` + ``loss_fn`` as one module whose forward returns the scalar loss."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable | None, num_inputs: int):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.num_inputs = num_inputs

    def forward(self, *batch):
        out = self.model(*batch[:self.num_inputs])
        if self.loss_fn is not None:
            out = self.loss_fn(out, *batch[self.num_inputs:])
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["loss"]
        elif isinstance(out, (tuple, list)):
            out = out[0]
        return out


def hlo_sharding(placements, rank: int, mesh_shape: Sequence[int]) -> str:
    """An HLO sharding string (``{devices=[1,4]<=[4]}``) for DTensor placements."""
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"{placements}: a Partial value has no HLO sharding annotation")
    tiles = [1] * rank
    order: list[int] = []                      # mesh axes in tile order
    for dim in range(rank):
        for axis, p in enumerate(placements):
            if isinstance(p, Shard) and p.dim == dim:
                tiles[dim] *= mesh_shape[axis]
                order.append(axis)
    replicated = [a for a in range(len(mesh_shape)) if a not in order]
    if not order:
        return "{replicated}"
    num_replicas = math.prod(mesh_shape[a] for a in replicated)
    dims = tiles + ([num_replicas] if num_replicas > 1 else [])
    perm = order + replicated
    if perm == sorted(perm):                   # devices in mesh order: XLA's short form
        iota = f"<=[{math.prod(mesh_shape)}]"
    else:
        iota = f"<=[{','.join(map(str, mesh_shape))}]T({','.join(map(str, perm))})"
    tail = " last_tile_dim_replicate" if num_replicas > 1 else ""
    return f"{{devices=[{','.join(map(str, dims))}]{iota}{tail}}}"


def export_stablehlo(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor],
                     loss_fn: Callable | None = None, plan: Plan | None = None) -> str:
    """The training step of ``model`` (+ ``loss_fn``) as StableHLO text (see module doc)."""
    from torch.export.experimental import _export_forward_backward

    from torchalpa.frontends.torch_export import split_inputs
    try:
        from torch_mlir import fx as mlir_fx
        from torch_mlir import ir
    except ImportError as e:
        raise ImportError("export_stablehlo needs torch-mlir: pip install "
                          "'torchalpa[stablehlo]'") from e
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _refuse_tied_parameters(model)
    inputs, _ = split_inputs(example_inputs, loss_fn)
    step = _StepWithLoss(model, loss_fn, len(inputs))
    try:
        exported = torch.export.export(step, tuple(example_inputs))
        joint = _export_forward_backward(exported.run_decompositions())
    except Exception as e:
        raise RuntimeError(f"torch.export could not capture the training step of "
                           f"{type(model).__name__}: {type(e).__name__}: {str(e)[:300]}") from e
    args = _argument_names(joint)
    _rewrite_for_torch_mlir(joint.graph_module)
    try:
        module = mlir_fx.stateless_fx_import(joint.graph_module, output_type="stablehlo")
    except Exception as e:   # TorchMlirCompilerError: an op torch-mlir cannot lower
        ops = sorted({str(n.target) for n in joint.graph_module.graph.nodes
                      if n.op == "call_function"})
        raise RuntimeError(
            f"torch-mlir could not lower the training step of {type(model).__name__} to "
            f"StableHLO ({str(e).strip().splitlines()[0][:200]}); its ATen ops are "
            f"{', '.join(ops)[:1500]}. Plan the module itself with torchalpa.plan, which "
            "needs no StableHLO") from e
    placed = {} if plan is None else {p.name: p for p in plan.parameters + plan.inputs}
    with module.context:
        main = next(op.operation for op in module.body.operations
                    if op.operation.name == "func.func"
                    and str(op.operation.attributes["sym_name"]).strip('"') == "main")
        dicts = []
        # torch_mlir.ir re-exports StringAttr/DictAttr/ArrayAttr from a native module the
        # checker cannot see: the ignores below are for that stub gap only
        for kind, name in args:
            attrs = {"torchalpa.kind": ir.StringAttr.get(kind),  # pyright: ignore[reportAttributeAccessIssue]
                     "torchalpa.name": ir.StringAttr.get(name)}  # pyright: ignore[reportAttributeAccessIssue]
            if name in placed:
                assert plan is not None  # placed is empty without a plan
                p = placed[name]
                attrs["mhlo.sharding"] = ir.StringAttr.get(  # pyright: ignore[reportAttributeAccessIssue]
                    hlo_sharding(p.placements, len(p.shape), plan.mesh_shape))
            dicts.append(ir.DictAttr.get(attrs))  # pyright: ignore[reportAttributeAccessIssue]
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(dicts)  # pyright: ignore[reportAttributeAccessIssue]
    return str(module)


def _rewrite_for_torch_mlir(gm: torch.fx.GraphModule) -> None:
    """Ops torch-mlir 20261001 cannot lower, as equivalent ones it can: ``squeeze.dims``
    (what ``squeeze(-1)`` decomposes to) is a ``view`` to its result's shape."""
    aten = torch.ops.aten
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.squeeze.dims:
            shape = list(node.meta["val"].shape)
            node.target = aten.view.default
            node.args = (node.args[0], shape)
    gm.recompile()


def _refuse_tied_parameters(model: torch.nn.Module) -> None:
    """torch.export routes every use of a tied parameter to one of its names and leaves
    the other without a gradient, which the joint export rejects: say so up front."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    tied = [group for group in names.values() if len(group) > 1]
    if tied:
        raise NotImplementedError(
            f"export_stablehlo does not support tied parameters ({', '.join(map(str, tied))}):"
            " torch.export gives the second name no gradient. Untie them for the export "
            "(e.g. model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone()))"
            ", or plan the module with torchalpa.plan")


def _argument_names(joint) -> list[tuple[str, str]]:
    """(kind, name) per argument of the joint graph: parameters (by FQN), buffers, inputs.

    The wrapper module prefixes FQNs with ``model.``; plans name parameters as the user's
    model does, so the prefix is dropped. Inputs are named ``input<i>`` as in ``capture``.
    """
    from torch.export.graph_signature import InputKind, OutputKind
    spec = joint.graph_signature
    kinds, num_inputs = [], 0
    for s in spec.input_specs:
        if s.kind == InputKind.PARAMETER:
            kinds.append(("param", s.target.removeprefix("model.")))
        elif s.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            kinds.append(("buffer", s.target.removeprefix("model.")))
        else:
            kinds.append(("input", f"input{num_inputs}"))
            num_inputs += 1
    grads = [s.target.removeprefix("model.") for s in spec.output_specs
             if s.kind == OutputKind.GRADIENT_TO_PARAMETER]
    params = [name for kind, name in kinds if kind == "param"]
    if [k for k, _ in kinds[:len(params)]] != ["param"] * len(params) or grads != params:
        raise RuntimeError("the exported step does not take its parameters first and return "
                           "one gradient per parameter in order; torchalpa cannot name them")
    return kinds
