"""A captured step at a smaller batch, derived from its capture without tracing again.

The planner weighs micro-batch counts: the step of one micro-batch of ``batch / k``
examples. Tracing the model again for each count costs as much as the first capture;
``rebatched_capture`` instead runs the captured fx graph once on fake tensors whose
inputs hold ``1 / k`` of the batch (dim 0 of every input, as ``split_micro_batches`` cuts
them), so every value gets the shape, strides and dtype the op gives it at that batch,
and makes the OpGraph again from it: the same nodes, names, module paths and source
lines, the shapes and costs of the micro-batch.

The shapes an op is *told* -- ``view``'s and ``expand``'s sizes -- are rescaled where the
batch runs through them: a view's dims form groups of equal products on both sides; a
group whose input shrank by ``k`` shrinks its one non-1 output dim by ``k``, or, where the
group splits into several dims (``B*S -> B, S``), its first one, which holds the batch as
long as the batch was the leading factor when the dims were merged (a value made by a
merge where it was not, and everything computed from it, is marked, and splitting such a
value again gives up). An expand keeps the input's new sizes and broadcasts to the same
sizes as before.

Anything else that could hold the batch as a number makes the derivation give up
(``None``, and the caller traces the model again): a broadcast or a constant whose size
is one of the batch-carrying sizes, an integer or float argument equal to one of them, to
the element count of a value the batch runs through, or to 1 or 2 over either (what
``mean``'s backward and ``mse_loss``'s decomposition bake in), a dim that does not divide
by ``k``, a parameter's gradient or an updated buffer whose shape changed.

Those checks look at numbers one by one and cannot see every way Python code turns the
batch size into a number (``loss.sum() / (x.shape[0] * 3)``), nor a model whose Python
branches on it. So a derivation is only trusted once it has been checked: ``MicroBatchSteps``
derives the first micro-batch count it is asked for and checks it -- by records of the
step's ops at the two batch sizes where its caller gives a ``check``
(``frontends/rebatch_check.py``: the step's Python run on ``meta`` tensors, a tenth of a
trace), else, or where those cannot vouch, by tracing that count too and comparing
(every op, argument, shape and line of generated code) -- and derives later counts only if
the check found the derived step the traced one (a number that depends on the batch
differs between the two batch sizes). A number that takes the same value at both batch
sizes is taken not to depend on the batch.

Since that check decides, ``MicroBatchSteps`` derives with ``trust_numbers``: a number
equal to a batch-carrying size by coincidence is kept as it is rather than refusing --
RoPE's ``arange(0, 128, 2)`` (head dim 128) beside a batch of 128 made LLaMA-3-70B's
target (batch 128) trace every micro-batch count. Were the number the batch, the derived
step would keep it where the traced one halves it, and the check refuses the derivation
as it refuses ``/ (batch * 3)``.
"""

from __future__ import annotations

import logging
import math
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, cast

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from torchalpa.frontends.block_remat import copied_codegen, lazy_graph_module
from torchalpa.frontends.meta_memo import MetaMemo, meta_like
from torchalpa.frontends.repeated import find_repeated_blocks
from torchalpa.frontends.torch_export import Capture, to_opgraph

__all__ = ["rebatched_capture", "CannotRebatch", "MicroBatchSteps", "same_step", "listed",
           "view_rescaled", "expand_rescaled"]

log = logging.getLogger("torchalpa.capture")

_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                    torch.ops.aten.reshape.default})
_EXPAND = torch.ops.aten.expand.default


class CannotRebatch(Exception):
    """Why a capture could not be derived at a smaller batch (the caller traces again)."""


class MicroBatchSteps:
    """The step of each micro-batch count of one batch, made once per count: traced by
    ``trace(k)``, or derived from a count already made (``rebatched_capture``) once a
    derivation has been found to give the traced step.

    The first count that could be derived is derived and checked: by ``check(captured,
    base, k)`` where one is given (``rebatch_check.RecordCheck``: records of the step's
    ops at both counts vouch for it, or say why not -- a tenth of a trace), else, or where
    it cannot vouch, by tracing that count too and comparing the two (``same_step``): a
    number in the graph that depends on the batch (``mse_loss``'s ``2 / numel``, a user's
    ``/ batch``) differs between them, and then every later count is traced as well.
    ``derived``: the counts made without a trace."""

    def __init__(self, trace: Callable[[int], Capture],
                 check: Callable[[Capture, int, int], str | None] | None = None):
        self.trace = trace
        self.check = check
        self.captures: dict[int, Capture] = {}
        self.checked: bool | None = None    # None: no derivation compared with a trace yet
        self.derived: set[int] = set()
        self.vouched = False                # the check (not a trace) found it the traced one
        self.check_trace: int | None = None  # the count traced to compare a derivation with

    def __call__(self, k: int) -> Capture:
        if k not in self.captures:
            self.captures[k] = self._made(k)
        return self.captures[k]

    def _made(self, k: int) -> Capture:
        base = next((j for j in sorted(self.captures) if k % j == 0), None)
        if base is None or self.checked is False:
            return self.trace(k)
        derived = rebatched_capture(self.captures[base], k // base, trust_numbers=True)
        if derived is None:
            return self.trace(k)
        if not self.checked and self.check is not None:
            start = time.perf_counter()
            reason = self.check(self.captures[base], base, k)
            seconds = time.perf_counter() - start
            if reason is None:
                log.info("the step derived at %d micro-batches checked without a trace "
                         "(%.2fs)", k, seconds)
                self.checked = self.vouched = True
            else:
                log.info("the step derived at %d micro-batches is checked by a trace (%s; "
                         "%.2fs)", k, reason, seconds)
        if self.checked:
            self.derived.add(k)
            return derived
        traced = self.trace(k)
        self.check_trace = k
        self.checked = same_step(derived, traced)
        if not self.checked:
            log.info("the step derived at %d micro-batches is not the traced one (a number "
                     "in it depends on the batch): every count is traced", k)
        return traced


    def how_made(self) -> str:
        """Which counts were traced and which derived, and what vouched for the derivation
        (records of the step's ops, or a trace it was compared with), for the plan's notes."""
        traced = sorted(set(self.captures) - self.derived)
        text = f"{listed(traced) or 'none'} traced"
        if self.derived:
            by = ("records of the step's ops at two batch sizes" if self.vouched
                  else f"the trace at {self.check_trace} micro-batches")
            text += f", {listed(self.derived)} derived (checked by {by})"
        elif self.checked is False:
            text += (f" (the derivation differed from the trace at {self.check_trace} "
                     "micro-batches: a number in the step depends on the batch)")
        return text


def listed(numbers) -> str:
    """``numbers`` sorted, comma-separated (micro-batch counts in notes)."""
    return ", ".join(str(n) for n in sorted(numbers))


def same_step(a: Capture, b: Capture) -> bool:
    """Whether two captures are one step: the same OpGraph nodes (names, ops, arguments,
    shapes, costs, module paths), outputs, graph meta and generated code."""
    return (a.graph.fingerprint() == b.graph.fingerprint() and list(a.graph) == list(b.graph)
            and a.graph.outputs == b.graph.outputs and a.graph.meta == b.graph.meta
            and a.gm.code == b.gm.code)


def rebatched_capture(captured: Capture, k: int, *, trust_numbers: bool = False
                      ) -> Capture | None:
    """``captured`` (the step at its batch) at ``1 / k`` of the batch, or None where the
    derivation cannot be sure of the result (the reason is logged at debug level).

    ``trust_numbers``: a number an op is given (or an expand broadcasts to) that equals a
    batch-carrying size is kept, not refused; only for a derivation that a trace at the
    same count confirms before it is trusted (``MicroBatchSteps``)."""
    if k == 1:
        return captured
    start = time.perf_counter()
    try:
        gm, kept = _rebatched_module(captured, k, trust_numbers)
    except CannotRebatch as e:
        log.debug("micro-batch capture not derived (1/%d of the batch): %s", k, e)
        return None
    kinds = ([("param", n) for n in captured.param_names]
             + [("buffer", n) for n in captured.buffer_names]
             + [("input", n) for n in captured.input_names])
    graph = to_opgraph(gm, kinds, captured.buffer_updates,
                       known={name: captured.graph.node(name) for name in kept
                              if name in captured.graph})
    graph.meta.update({key: value for key, value in captured.graph.meta.items()
                       if key != "repeated_blocks"})
    graph.meta["repeated_blocks"] = find_repeated_blocks(graph)
    graph.check()
    seconds = time.perf_counter() - start
    log.info("derived the step at 1/%d of the batch from its capture in %.2fs", k, seconds)
    return replace(captured, graph=graph, gm=gm, seconds=seconds)


def _rebatched_module(captured: Capture, k: int, trust_numbers: bool = False
                      ) -> tuple[fx.GraphModule, list[str]]:
    """The fx graph at the new batch, and its op nodes whose values did not change."""
    old = captured.gm.graph
    graph = fx.Graph()
    graph._codegen = copied_codegen(old._codegen)
    graph.output(graph.graph_copy(old, {}))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_input = len(captured.param_names) + len(captured.buffer_names)
    state = _Rebatch(k, trust_numbers)
    with torch.no_grad():
        for i, n in enumerate(placeholders):
            val = n.meta["val"]
            shape = tuple(val.shape)
            if i < first_input:               # parameters and buffers stay as they are
                state.old[n] = val
                continue
            if not shape:
                raise CannotRebatch("an input has no dim 0 to split")
            shape = (state.shrunk(shape[0], "an input's batch dim"),) + shape[1:]
            state.set(n, torch.empty_strided(shape, _strides(val, shape), dtype=val.dtype,
                                             device="meta"))
        for n in graph.nodes:
            if n.op == "call_function":
                state.run(n)
            elif n.op not in ("placeholder", "output"):
                raise CannotRebatch(f"node {n.name} is a {n.op}")
    _check_outputs(graph, old, len(captured.param_names))
    return lazy_graph_module(captured.gm, graph), state.skipped


def _strides(val: torch.Tensor, shape: tuple) -> tuple:
    """Contiguous strides for ``shape`` where ``val`` was contiguous; else a refusal (an
    input's layout at another batch is not known)."""
    if not val.is_contiguous():
        raise CannotRebatch("an input is not contiguous")
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _Rebatch:
    """The fake run: new values per node, the sizes that carry the batch, marked values.

    A node none of whose inputs changed (a weight's cast or transpose, a constant) keeps
    its value without running the op, once its arguments are checked."""

    def __init__(self, k: int, trust_numbers: bool = False):
        self.k = k
        self.trust_numbers = trust_numbers        # keep numbers that equal a batch size
        self.values: dict[fx.Node, Any] = {}      # meta tensors, made when an op reads them
        self.old: dict[fx.Node, Any] = {}         # each node's value at the full batch
        self.changed: set[fx.Node] = set()        # nodes whose value changed
        self.skipped: list[str] = []              # ops not run: every input as it was
        self.scaled: set[int] = set()      # sizes at the full batch of dims that shrank
        self.numels: set[int] = set()      # element counts at the full batch of values that did
        self.marked: set[fx.Node] = set()  # the batch is not leading in some dim
        self.memo = MetaMemo()             # identical layers: each distinct op call runs once

    def shrunk(self, size: int, what: str) -> int:
        if size % self.k:
            raise CannotRebatch(f"{what} ({size}) does not divide by {self.k}")
        if self.k > 1 and size > 1:
            self.scaled.add(size)
        return size // self.k

    def set(self, n: fx.Node, val) -> None:
        """``val`` (meta tensors) is the node's value; its ``meta["val"]`` is the fake
        tensor of the capture's mode over it, on the device the capture's was."""
        old = self.old[n] = n.meta.get("val")
        if _layouts(old) == _layouts(val):
            self.values[n] = val
            return                            # the old value stands (n.meta is the capture's)
        self.changed.add(n)
        self.values[n] = val
        n.meta["val"] = _faked(val, old)
        for o, v in zip(_tensors(old), _tensors(val)):
            if o.shape != v.shape and o.numel() > 1:
                self.numels.add(int(o.numel()))
        if isinstance(old, torch.Tensor) and isinstance(val, torch.Tensor):
            for a, b in zip(old.shape, val.shape):
                if a != b:
                    self.scaled.add(int(a))
        if "tensor_meta" in n.meta:
            n.meta["tensor_meta"] = _tensor_meta(n.meta["tensor_meta"], val)
        n.meta.pop("eager_input_vals", None)

    def value(self, n: fx.Node):
        if n not in self.values:
            self.values[n] = meta_like(self.old[n])
        return self.values[n]

    def shape(self, n: fx.Node) -> tuple:
        return tuple((self.values[n] if n in self.changed else self.old[n]).shape)

    def shapes(self, n: fx.Node) -> tuple[tuple, tuple]:
        """The shape of ``n``'s first argument before and now."""
        first = cast(fx.Node, n.args[0])
        return tuple(self.old[first].shape), self.shape(first)

    def run(self, n: fx.Node) -> None:
        inputs = n.all_input_nodes
        if any(a in self.marked for a in inputs):
            self.marked.add(n)
        sizes = None
        if n.target in _VIEWS:
            sizes = self.view_sizes(n, *self.shapes(n))
        elif n.target is _EXPAND:
            sizes = self.expand_sizes(n, *self.shapes(n))
        elif n.target is not operator.getitem:
            self.check_numbers(n)
        if not any(a in self.changed for a in inputs):
            self.old[n] = n.meta.get("val")   # the same op on the same values
            self.skipped.append(n.name)
            return
        if sizes is not None:
            n.args = (n.args[0], sizes, *n.args[2:])
        args = _on_meta(map_arg(n.args, self.value))
        kwargs = _on_meta(map_arg(n.kwargs, self.value))
        try:
            val = self.memo(n.target, args, kwargs)
        except Exception as e:   # the op refuses the new shapes: trace instead
            raise CannotRebatch(f"{n.target} ({n.name}) at the new shapes: "
                                f"{type(e).__name__}: {str(e)[:200]}") from e
        self.set(n, val)

    def check_numbers(self, n: fx.Node) -> None:
        """Refuse an op told a number that may be a batch-carrying size (unless trusted)."""
        if self.trust_numbers:
            return
        sizes = self.scaled | self.numels
        for v in _leaves((n.args, n.kwargs)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if _batch_number(float(v), sizes):
                raise CannotRebatch(f"{n.target} ({n.name}) is given {v}, which may be a "
                                    "size the batch runs through")

    def view_sizes(self, n: fx.Node, a: tuple, b: tuple) -> list[int]:
        """A view's sizes at the new batch (``a``, ``b``: its input's shape before, now)."""
        sizes, merged = view_rescaled(n.name, list(cast(Sequence[int], n.args[1])), a, b,
                                      tuple(n.meta["val"].shape), n.args[0] in self.marked)
        if merged:
            self.marked.add(n)
        return sizes

    def expand_sizes(self, n: fx.Node, a: tuple, b: tuple) -> list[int]:
        """An expand's sizes at the new batch (``a``, ``b``: its input's shape before, now)."""
        return expand_rescaled(n.name, list(cast(Sequence[int], n.args[1])), a, b,
                               None if self.trust_numbers else self.scaled)


def view_rescaled(name: str, old_sizes: list[int], a: tuple, b: tuple, old_out: tuple,
                  marked: bool) -> tuple[list[int], bool]:
    """A view's sizes where its input's shape went from ``a`` to ``b`` (``old_sizes``, its
    sizes before, made ``old_out``; ``marked``: its input may not lead with the batch), and
    whether the batch stops leading in its result (a merge where it was not first)."""
    if a == b:
        return old_sizes, False
    groups = _groups(a, old_out)
    if groups is None:
        raise CannotRebatch(f"view {name}: {a} -> {old_out} has no common refinement")
    out, merged = list(old_out), False
    for ins, outs in groups:
        changed = [d for d in ins if a[d] != b[d]]
        if not changed:
            continue
        if len(changed) > 1 or a[changed[0]] % max(b[changed[0]], 1) or b[changed[0]] == 0:
            raise CannotRebatch(f"view {name}: several dims of one group shrank")
        d = changed[0]
        k = a[d] // b[d]
        big_in = [x for x in ins if a[x] != 1]
        big_out = [x for x in outs if old_out[x] != 1]
        if not big_out:
            raise CannotRebatch(f"view {name}: the batch lands in no dim")
        if len(big_out) > 1 and (big_in[0] != d or marked):
            raise CannotRebatch(f"view {name} splits a dim whose leading factor may not "
                                "be the batch")
        if len(big_in) > 1 and big_in[0] != d:
            merged = True
        target = big_out[0]
        if out[target] % k:
            raise CannotRebatch(f"view {name}: dim {target} does not divide by {k}")
        out[target] //= k
    return [-1 if s == -1 else out[i] for i, s in enumerate(old_sizes)], merged


def expand_rescaled(name: str, old_sizes: list[int], a: tuple, b: tuple,
                    scaled: set[int] | None) -> list[int]:
    """An expand's sizes where its input's shape went from ``a`` to ``b``: the input's
    new sizes, the broadcast ones kept (refused where one is in ``scaled``, the sizes the
    batch runs through; None: numbers trusted)."""
    offset = len(old_sizes) - len(a)
    sizes = []
    for p, s in enumerate(old_sizes):
        d = p - offset
        if d >= 0 and a[d] != 1:
            sizes.append(-1 if s == -1 else b[d])
        elif scaled is not None and s in scaled:
            raise CannotRebatch(f"expand {name} broadcasts to {s}, a size the batch "
                                "runs through")
        else:
            sizes.append(s)
    return sizes


def _batch_number(v: float, sizes: set[int]) -> bool:
    """Whether ``v`` is one of ``sizes``, or 1 or 2 over one of them or over one less
    (a mean's, ``mse_loss``'s or an unbiased variance's scale)."""
    if v == 0 or not math.isfinite(v):
        return False
    if v.is_integer() and int(v) in sizes:
        return True
    for c in (1.0, 2.0):
        r = c / abs(v)
        near = round(r)
        if abs(r - near) <= 1e-6 * r and (near in sizes or near + 1 in sizes):
            return True
    return False


def _tensors(val) -> list[torch.Tensor]:
    """The tensors of a value (a tensor or a tuple of them)."""
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return [val] if isinstance(val, torch.Tensor) else []


def _layouts(val):
    """Shapes, strides and offsets of a value (a tensor or a tuple of them)."""
    if isinstance(val, (list, tuple)):
        return tuple(_layouts(v) for v in val)
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), val.stride(), val.storage_offset(), val.dtype)
    return val


def _on_meta(tree: Any) -> Any:
    """``tree`` with every device it names made ``meta``: an op that makes a tensor
    (``full``, ``arange``, ``_to_copy``) makes it without memory; ``_faked`` puts the
    captured device back on the value."""
    if isinstance(tree, torch.device):
        return _META
    if isinstance(tree, (list, tuple)):
        return type(tree)(_on_meta(a) for a in tree) if any(
            isinstance(a, (torch.device, list, tuple, dict)) for a in tree) else tree
    if isinstance(tree, dict):
        return {key: _on_meta(a) for key, a in tree.items()}
    return tree


def _leaves(tree):
    """The numbers, tensors and nodes in nested arguments."""
    if isinstance(tree, (list, tuple)):
        for a in tree:
            yield from _leaves(a)
    elif isinstance(tree, dict):
        for a in tree.values():
            yield from _leaves(a)
    else:
        yield tree


_META = torch.device("meta")


def _faked(val, old):
    """``val``'s meta tensors as fake tensors of ``old``'s mode and device."""
    from torch._subclasses.fake_tensor import FakeTensor
    if isinstance(val, (list, tuple)):
        olds = old if isinstance(old, (list, tuple)) else [old] * len(val)
        return type(val)(_faked(v, o) for v, o in zip(val, olds))
    if isinstance(val, torch.Tensor) and isinstance(old, FakeTensor):
        return FakeTensor(old.fake_mode, val, old.device)
    return val


def _groups(a: tuple, b: tuple) -> list[tuple[list[int], list[int]]] | None:
    """The dims of two shapes of one numel in groups of equal products, in order."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        ins, outs, pa, pb = [], [], 1, 1
        if i < len(a):
            pa, i = a[i], i + 1
            ins.append(i - 1)
        if j < len(b):
            pb, j = b[j], j + 1
            outs.append(j - 1)
        while pa != pb:
            if pa < pb and i < len(a):
                pa, i = pa * a[i], i + 1
                ins.append(i - 1)
            elif pb < pa and j < len(b):
                pb, j = pb * b[j], j + 1
                outs.append(j - 1)
            else:
                return None
        groups.append((ins, outs))
    return groups


def _tensor_meta(meta: Any, val: Any) -> Any:
    """``tensor_meta`` (shape and strides) following the new value."""
    if isinstance(meta, (list, tuple)) and not hasattr(meta, "_replace"):
        vals = val if isinstance(val, (list, tuple)) else [val] * len(meta)
        return type(meta)(_tensor_meta(m, v) for m, v in zip(meta, vals))
    replaced = getattr(meta, "_replace", None)       # a TensorMetadata (a named tuple)
    if replaced is not None and isinstance(val, torch.Tensor):
        return replaced(shape=val.shape, stride=val.stride())
    return meta


def _check_outputs(graph: fx.Graph, old: fx.Graph, num_params: int) -> None:
    """Gradients and buffer updates keep their shapes; the loss stays a scalar."""
    def shapes(g: fx.Graph):
        out = next(n for n in g.nodes if n.op == "output")
        return [tuple(o.meta["val"].shape) if isinstance(o, fx.Node) else None
                for o in out.args[0]]
    new, before = shapes(graph), shapes(old)
    if new[1:] != before[1:] or new[0] != before[0]:
        raise CannotRebatch("a gradient, an updated buffer or the loss changed shape")
