# torch_mlir.ir re-exports Context/Location from a native module the checker cannot see
# pyright: reportAttributeAccessIssue=false
"""Source locations for an exported torch step: each StableHLO op says which line of the
user's model it came from, as ``loc("net.0"("model.py":40:0))`` (module path, then file
and line).

The joint forward+backward graph of ``_export_forward_backward`` is a retrace: its nodes'
stack traces point into the generated graph module, and they carry no module stack. The
forward graph it was made from (``ExportedProgram.run_decompositions()``) still has both,
and the retrace keeps its node names, so ``source_of`` reads, per forward node, the module
path (``nn_module_stack``'s innermost entry, the wrapper's ``model.`` prefix dropped) and
the innermost stack frame that is the user's code (not torch, not a site package, not
torchalpa's export wrapper). Backward nodes get no location (``loc(unknown)``), never the
line of the forward op before them.

``import_with_locations`` runs torch-mlir's importer with these locations; torch-mlir
keeps an op's location through its lowering to StableHLO, and ``frontends/stablehlo.py``
reads them back into ``OpNode.module`` / ``OpNode.stack``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

__all__ = ["SourceLine", "source_of", "import_with_locations"]

_EXPORT_WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "export.py")
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass(frozen=True)
class SourceLine:
    """Where one op of the step comes from: module path (may be "") and file:line."""

    module: str
    file: str
    line: int


def _is_user_frame(path: str) -> bool:
    path = os.path.abspath(path)
    return not (path.startswith(_TORCH_DIR) or f"{os.sep}site-packages{os.sep}" in path
                or path == _EXPORT_WRAPPER or path.startswith("<"))


def _user_frame(stack_trace: str) -> tuple[str, int] | None:
    """The innermost frame of a stack trace (most recent call last) in the user's code."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', stack_trace or "")
    for path, line in reversed(frames):
        if _is_user_frame(path):
            return path, int(line)
    return None


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return "" if path in ("", "model") else re.sub(r"^model\.", "", path)


def source_of(forward: torch.fx.Graph, joint: torch.fx.Graph) -> dict[str, SourceLine]:
    """Per node name of ``joint``: its source line, read from the node of ``forward`` with
    the same name and target (forward ops only)."""
    by_name = {n.name: n for n in forward.nodes if n.op == "call_function"}
    found = {}
    for node in joint.nodes:
        original = by_name.get(node.name)
        if node.op != "call_function" or original is None or original.target != node.target:
            continue
        frame = _user_frame(original.meta.get("stack_trace", ""))
        module = _module_path(original)
        if frame is not None or module:
            path, line = frame if frame is not None else ("", 0)
            found[node.name] = SourceLine(module, path, line)
    return found


def import_with_locations(gm: torch.fx.GraphModule, sources: dict[str, SourceLine]):
    """``torch_mlir.fx.stateless_fx_import(gm, output_type="stablehlo")`` whose ops carry
    ``sources``' locations (others: unknown)."""
    from torch_mlir import fx as mlir_fx
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.extras.fx_importer import ContextCache, FxImporter

    context = ir.Context()
    torch_d.register_dialect(context)

    class _Locations(ContextCache):
        """torch-mlir's cache, whose node locations are ours (forward lines kept,
        backward ops unknown) instead of the retrace's stack traces."""

        def get_node_location(self, node: torch.fx.Node):
            source = sources.get(node.name)
            if source is None:
                return ir.Location.unknown(context=context)
            where = ir.Location.file(source.file, source.line, col=0, context=context) \
                if source.file else ir.Location.unknown(context=context)
            return ir.Location.name(source.module, childLoc=where, context=context) \
                if source.module else where

    importer = FxImporter(context=context)
    importer._cc = _Locations(context, py_attr_tracker=importer._py_attr_tracker)
    return mlir_fx.stateless_fx_import(gm, output_type="stablehlo", fx_importer=importer)
