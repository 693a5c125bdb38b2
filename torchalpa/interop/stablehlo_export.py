"""``export_stablehlo``: a torch training step (forward, loss and backward) as StableHLO.

The step is exported with ``torch.export`` and its joint forward+backward graph
(``_export_forward_backward``) is lowered by torch-mlir
(``torch_mlir.fx.stateless_fx_import(..., output_type="stablehlo")``). ``@main`` takes the
trainable parameters, the buffers, then the example inputs (model inputs, then targets)
and returns ``(loss, *grads)`` in parameter order: the convention
``frontends/stablehlo.py`` reads, so ``torchalpa.plan(export_stablehlo(...), ())``
plans it. Each argument carries ``torchalpa.kind`` (param, buffer, input) and
``torchalpa.name`` (the parameter's FQN); with ``plan=`` the parameters, inputs and
gradients also carry sharding annotations, which XLA honours when it compiles the program
for the plan's mesh: ``sharding="mhlo"`` (GSPMD's HLO sharding strings, devices in the
plan's mesh order) or ``"sdy"`` (Shardy). ``torchalpa/interop/hlo_annotate.py`` writes them; the
plan's resharding points get sharding constraints too when the plan was made from this
StableHLO (``torchalpa.plan(text, ())``), not from the model's ATen graph. Forward ops carry
the location of the model code they come from (``torchalpa/interop/stablehlo_locations.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from torchalpa.core.plan import Plan

__all__ = ["export_stablehlo"]


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




def export_stablehlo(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor],
                     loss_fn: Callable | None = None, plan: Plan | None = None, *,
                     sharding: str = "mhlo") -> str:
    """The training step of ``model`` (+ ``loss_fn``) as StableHLO text (see module doc)."""
    from torch.export.experimental import _export_forward_backward

    from torchalpa.frontends.torch_export import split_inputs
    from torchalpa.interop.stablehlo_locations import import_with_locations, source_of
    try:
        from torch_mlir import ir
    except ImportError as e:
        raise ImportError("export_stablehlo needs torch-mlir: pip install "
                          "'torchalpa[stablehlo]'") from e
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inputs, _ = split_inputs(example_inputs, loss_fn)
    step: torch.nn.Module = _StepWithLoss(model, loss_fn, len(inputs))
    if _tied_groups(model):
        step = _SharedParameters(step)
    try:
        exported = torch.export.export(step, tuple(example_inputs))
        forward = exported.run_decompositions()
        joint = _export_forward_backward(forward)
    except Exception as e:
        raise RuntimeError(f"torch.export could not capture the training step of "
                           f"{type(model).__name__}: {type(e).__name__}: {str(e)[:300]}") from e
    args = _argument_names(joint, getattr(step, "fqns", None))
    _rewrite_for_torch_mlir(joint.graph_module)
    try:
        module = import_with_locations(joint.graph_module,
                                       source_of(forward.graph, joint.graph_module.graph))
    except Exception as e:   # TorchMlirCompilerError: an op torch-mlir cannot lower
        ops = sorted({str(n.target) for n in joint.graph_module.graph.nodes
                      if n.op == "call_function"})
        raise RuntimeError(
            f"torch-mlir could not lower the training step of {type(model).__name__} to "
            f"StableHLO ({str(e).strip().splitlines()[0][:200]}); its ATen ops are "
            f"{', '.join(ops)[:1500]}. Plan the module itself with torchalpa.plan, which "
            "needs no StableHLO") from e
    with module.context:
        main = next(op.operation for op in module.body.operations
                    if op.operation.name == "func.func"
                    and str(op.operation.attributes["sym_name"]).strip('"') == "main")
        # torch_mlir.ir re-exports StringAttr/DictAttr/ArrayAttr from a native module the
        # checker cannot see: the ignores below are for that stub gap only
        main.attributes["arg_attrs"] = ir.ArrayAttr.get([  # pyright: ignore[reportAttributeAccessIssue]
            ir.DictAttr.get({"torchalpa.kind": ir.StringAttr.get(kind),  # pyright: ignore[reportAttributeAccessIssue]
                             "torchalpa.name": ir.StringAttr.get(name)})  # pyright: ignore[reportAttributeAccessIssue]
            for kind, name in args])
        text = module.operation.get_asm(enable_debug_info=True)
    if plan is None:
        return text
    from torchalpa.interop.hlo_annotate import annotate_stablehlo
    return annotate_stablehlo(text, plan, dialect=sharding).text


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


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names sharing one parameter (GPT's tied embedding and output head), first name first."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


class _SharedParameters(torch.nn.Module):
    """The step with each tied parameter passed once, under its first name.

    ``torch.export`` lists a tied parameter under both names but routes every use to one
    of them, and the joint export then refuses the other for having no gradient. Here the
    step's parameters (deduplicated, as ``named_parameters`` gives them) are this module's
    own ``p<i>``, and ``functional_call(..., tie_weights=True)`` feeds each to every name
    it is tied to: one argument and one gradient (the sum over both uses) per parameter.
    """

    step: torch.nn.Module

    def __init__(self, step: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "step", step)          # not a submodule: its names stay out
        self.fqns = {f"p{i}": name.removeprefix("model.")
                     for i, (name, _) in enumerate(step.named_parameters())}
        for i, (_, p) in enumerate(step.named_parameters()):
            self.register_parameter(f"p{i}", p)

    def forward(self, *batch):
        params = {f"model.{fqn}": getattr(self, key) for key, fqn in self.fqns.items()}
        return torch.func.functional_call(self.step, params, batch, tie_weights=True)


def _argument_names(joint, fqns: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(kind, name) per argument of the joint graph: parameters (by FQN), buffers, inputs.

    The wrapper module prefixes FQNs with ``model.``; plans name parameters as the user's
    model does, so the prefix is dropped (``fqns`` maps ``_SharedParameters``' own names
    back). Inputs are named ``input<i>`` as in ``capture``.
    """
    from torch.export.graph_signature import InputKind, OutputKind
    spec = joint.graph_signature
    fqns = fqns or {}
    kinds, num_inputs = [], 0
    for s in spec.input_specs:
        if s.kind == InputKind.PARAMETER:
            kinds.append(("param", fqns.get(s.target, s.target.removeprefix("model."))))
        elif s.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            kinds.append(("buffer", s.target.removeprefix("model.")))
        else:
            kinds.append(("input", f"input{num_inputs}"))
            num_inputs += 1
    grads = [fqns.get(s.target, s.target.removeprefix("model.")) for s in spec.output_specs
             if s.kind == OutputKind.GRADIENT_TO_PARAMETER]
    params = [name for kind, name in kinds if kind == "param"]
    if [k for k, _ in kinds[:len(params)]] != ["param"] * len(params) or grads != params:
        raise RuntimeError("the exported step does not take its parameters first and return "
                           "one gradient per parameter in order; torchalpa cannot name them")
    return kinds
