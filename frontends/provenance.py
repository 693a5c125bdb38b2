"""Where each traced op came from: the module path and the user's source line.

While a model is traced, ``Provenance.tracing()`` tags every fx node with the path of the
innermost module that ran it (``layers.3.mlp``, via module hooks) and the "file:line" of
the user code that made the torch call (``node.meta["stack_trace"]``, found by walking
up the Python stack past torch's own frames). Backward nodes are tagged after the trace
with the tags of the forward op they differentiate (autograd gives both the same
sequence number, the mechanism AOTAutograd uses). When tracing fails, ``explain`` names
the module and the line the failure came from and suggests a fix.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import sys
from collections.abc import Iterable
from types import CodeType, FrameType, TracebackType

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from torchalpa.frontends.opset import FusedCalls, routed_matmul, routed_sdpa

__all__ = ["MODULE_KEY", "Provenance", "copy_forward_tags_to_backward", "short_path",
           "module_of", "line_of", "tracing_backward", "is_backward"]

MODULE_KEY = "torchalpa_module"
BACKWARD_KEY = "torchalpa_backward"
"""Set on nodes traced while backward ran, where torch does not mark them itself:
PyTorch 2.13 sets ``meta["autograd_backward"]``, 2.11 has no such mark."""
MARKS_BACKWARD = hasattr(fx_traceback, "_set_autograd_backward")


@contextlib.contextmanager
def tracing_backward():
    """Around the traced backward call, on a PyTorch that does not mark backward nodes
    (2.11): mark them (``BACKWARD_KEY``), so ``copy_forward_tags_to_backward`` finds them,
    and let an empty stack clear the node's stack trace. There, autograd's hooks set the
    gradient-accumulation marker after each backward node and the next node's empty stack
    left it in place, so every later backward node looked like an accumulation (and lost
    its module); PyTorch 2.13 clears it."""
    if MARKS_BACKWARD:
        yield
        return
    keeping = fx_traceback.set_stack_trace

    def set_stack_trace(stack: list[str]) -> None:
        if stack:
            keeping(stack)
        else:
            fx_traceback.current_meta.pop("stack_trace", None)

    fx_traceback.set_stack_trace = set_stack_trace
    try:
        with fx_traceback.annotate({BACKWARD_KEY: True}):
            yield
    finally:
        fx_traceback.set_stack_trace = keeping


def is_backward(node: fx.Node) -> bool:
    return bool(node.meta.get("autograd_backward")
                or (node.meta.get("custom") or {}).get(BACKWARD_KEY))

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FRONTENDS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MARKERS_FILE = os.path.join("torchalpa", "ops", "markers.py")
# attention's custom-op wrapper: the user's line is the scaled_dot_product_attention call
_ATTENTION_FILE = os.path.join("torchalpa", "ops", "attention.py")


@functools.lru_cache(maxsize=4096)
def _is_internal(filename: str) -> bool:
    """torch's own files and the frontend's: frames that are never the user's line."""
    return (filename.startswith((_TORCH_DIR, _FRONTENDS_DIR)) or filename.startswith("<")
            or filename.endswith((_MARKERS_FILE, _ATTENTION_FILE))
            or os.path.basename(filename) == "contextlib.py")


@functools.lru_cache(maxsize=4096)
def short_path(filename: str) -> str:
    """A file name short enough for messages: relative to the working dir or site-packages."""
    marker = os.sep + "site-packages" + os.sep
    if marker in filename:
        return filename.split(marker, 1)[1]
    cwd = os.getcwd() + os.sep
    if filename.startswith(cwd):
        return filename[len(cwd):]
    return os.path.basename(filename)


def _user_line(frame: FrameType | None, stop: frozenset[CodeType]) -> str:
    """"file:line" of the innermost non-internal frame, or "" if ``stop`` comes first."""
    while frame is not None:
        code = frame.f_code
        if code in stop:
            return ""
        if not _is_internal(code.co_filename):
            return f"{short_path(code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def module_of(node: fx.Node) -> str:
    return (node.meta.get("custom") or {}).get(MODULE_KEY, "")


def line_of(node: fx.Node) -> str:
    return node.meta.get("stack_trace") or ""


class Provenance:
    """Tags traced nodes with module path and user line; explains trace failures.

    ``stop`` holds the code objects of the frontend's own wrappers (the joint function):
    a torch call reached from them directly (``loss_fn=F.mse_loss``) has no user line.
    """

    def __init__(self, model: torch.nn.Module, stop: Iterable[CodeType] = ()):
        self.model = model
        self.stop = frozenset(stop)
        self.paths: list[str] = []          # open modules, innermost last
        self.in_loss = False                # set by the capture while loss_fn runs
        self.last_path: str | None = None   # innermost module at the latest torch call

    @contextlib.contextmanager
    def tracing(self):
        """Module hooks + the torch-function mode, for the duration of one trace."""
        with fx_traceback.preserve_node_meta(), self._module_hooks(), \
                FusedCalls(on_call=self._on_call), routed_sdpa(), routed_matmul():
            yield

    def _on_call(self):
        if not self.paths and not self.in_loss:
            return None                      # torch's own calls while it sets up the trace
        line = _user_line(sys._getframe(2), self.stop)
        if line:
            self.last_path = self.paths[-1] if self.paths else None
        meta = fx_traceback.current_meta
        previous = meta.get("stack_trace")
        if line:
            meta["stack_trace"] = line
        else:
            meta.pop("stack_trace", None)
        return functools.partial(_restore_stack_trace, previous)

    @contextlib.contextmanager
    def _module_hooks(self):
        open_scopes: list[contextlib.AbstractContextManager] = []
        handles = []

        def enter(path):
            def hook(module, args):
                scope = fx_traceback.annotate({MODULE_KEY: path})
                scope.__enter__()
                open_scopes.append(scope)
                self.paths.append(path)
            return hook

        def leave(module, args, output):
            open_scopes.pop().__exit__(None, None, None)
            self.paths.pop()

        for path, module in self.model.named_modules():
            handles.append(module.register_forward_pre_hook(enter(path)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            while open_scopes:
                open_scopes.pop().__exit__(None, None, None)
            self.paths.clear()

    # -- failures ---------------------------------------------------------------------
    def where(self, e: BaseException) -> tuple[str | None, str, str]:
        """(module path, "file:line", source text) of the user code that raised ``e``.

        The module is the innermost one open at the last torch call (None: outside the
        model, i.e. in the loss function).
        """
        line, text, path = "", "", self.last_path
        path_of = {id(m): p for p, m in self.model.named_modules()}
        tb: TracebackType | None = e.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            owner = tb.tb_frame.f_locals.get("self")
            if id(owner) in path_of and isinstance(owner, torch.nn.Module):
                path = path_of[id(owner)]         # the innermost module whose method raised
            if not _is_internal(code.co_filename) and code not in self.stop:
                line = f"{short_path(code.co_filename)}:{tb.tb_lineno}"
                text = linecache.getline(code.co_filename, tb.tb_lineno).strip()
            tb = tb.tb_next
        return path, line, text

    def describe_module(self, path: str | None) -> str:
        if path is None:
            return "the loss function"
        try:
            cls = type(self.model.get_submodule(path)).__name__
        except AttributeError:
            cls = "?"
        return f"the top-level module ({cls})" if path == "" else f"module '{path}' ({cls})"


def _restore_stack_trace(previous: str | None) -> None:
    meta = fx_traceback.current_meta
    if previous is None:
        meta.pop("stack_trace", None)
    else:
        meta["stack_trace"] = previous


def copy_forward_tags_to_backward(gm: fx.GraphModule) -> None:
    """Give each backward node the module and line of the forward op it differentiates.

    The first forward node of a sequence number (``seq_nr``) is the op that created the
    autograd node; backward nodes carry the same number. Autograd's own gradient
    accumulation (a value read twice gets the sum of two gradients) belongs to no forward
    op and stays untagged: passes place it by the values it adds (tagging it like one of
    them would drag, say, a residual stream's whole gradient chain into one layer).
    """
    first_forward: dict[int, fx.Node] = {}
    for n in gm.graph.nodes:
        if "seq_nr" in n.meta and not is_backward(n):
            first_forward.setdefault(n.meta["seq_nr"], n)
    for n in gm.graph.nodes:
        if not is_backward(n):
            continue
        fwd = None if n.meta.get("is_gradient_acc") else first_forward.get(n.meta.get("seq_nr"))
        if fwd is None:
            n.meta.pop("stack_trace", None)
            if n.meta.get("custom"):
                n.meta["custom"] = {k: v for k, v in n.meta["custom"].items() if k != MODULE_KEY}
            continue
        path = module_of(fwd)
        n.meta["custom"] = {**(n.meta.get("custom") or {}), MODULE_KEY: path}
        if line_of(fwd):
            n.meta["stack_trace"] = line_of(fwd)
        else:
            n.meta.pop("stack_trace", None)
