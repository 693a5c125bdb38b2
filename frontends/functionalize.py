"""Make a traced joint graph purely functional, turning buffer writes into outputs.

``make_fx`` records in-place ops as they ran (``bn.num_batches_tracked.add_(1)``, the
batch-norm running statistics ``copy_``, ``relu_``, ``x[idx] = y``). Because it rebinds
each tensor to the node that last wrote it, later readers already consume the written
value; so an in-place op can simply become its out-of-place twin (``add_`` -> ``add``,
``copy_`` -> ``copy``), provided nothing reads the written storage through another alias
(a view taken before, the tensor a written view views) afterwards. ``functionalize`` does
that fast rewrite and reports the first write for which it is not enough
(``NeedsFunctionalization``); ``retrace_functional`` then re-traces the graph through
PyTorch's functionalization (writes into views become ``*_scatter`` ops), keeping each
node's module and line, and the fast rewrite finishes the job (the writes into inputs that
functionalization leaves at the end). Writes into a buffer (or frozen parameter) become
the buffer's new value, which the capture adds to the graph outputs; writes into
trainable parameters or inputs are refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._ops import OpOverload

__all__ = ["functionalize", "retrace_functional", "NeedsFunctionalization",
           "functional_variant", "is_view_op"]


class NeedsFunctionalization(Exception):
    """An in-place write the fast rewrite cannot express (``node``: the write)."""

    def __init__(self, node: fx.Node, alias: fx.Node):
        super().__init__(f"{node.name} writes storage that {alias.name} also reads")
        self.node, self.alias = node, alias


@functools.cache
def functional_variant(op: OpOverload) -> OpOverload | None:
    """The out-of-place overload with the same arguments as in-place ``op`` (or None)."""
    name = op._schema.name.split("::")[-1]
    if not name.endswith("_"):
        return None
    namespace = getattr(torch.ops, op.namespace)
    packet = getattr(namespace, name[:-1], None)
    if packet is None:
        return None
    want = [(a.name, str(a.type)) for a in op._schema.arguments]
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        schema = candidate._schema
        if not schema.is_mutable and [(a.name, str(a.type)) for a in schema.arguments] == want:
            return candidate
    return None


@functools.cache
def is_view_op(op) -> bool:
    """Whether ``op``'s result aliases its first operand without writing it."""
    if not isinstance(op, OpOverload) or not op._schema.returns:
        return False
    alias = op._schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _written_args(op: OpOverload) -> list[int]:
    return [i for i, a in enumerate(op._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def functionalize(gm: fx.GraphModule, leaf_kind: dict[str, tuple[str, str]],
                  fail: Callable[[fx.Node, str], Exception]) -> dict[str, fx.Node]:
    """Rewrite ``gm``'s in-place ops in place; return {buffer FQN: node of its final value}.

    ``leaf_kind`` maps placeholder names to (kind, FQN); ``fail(node, why)`` builds the
    error to raise for a write that has no functional meaning here.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    root: dict[fx.Node, fx.Node] = {}          # written value -> the tensor first written
    updates: dict[str, fx.Node] = {}
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or not isinstance(n.target, OpOverload):
            continue
        if not n.target._schema.is_mutable:
            continue
        written = _written_args(n.target)
        if written != [0] or not n.args or not isinstance(n.args[0], fx.Node):
            raise fail(n, f"{n.target} writes into {len(written)} of its arguments")
        functional = functional_variant(n.target)
        if functional is None:
            raise fail(n, f"the in-place op {n.target} has no out-of-place form")
        dest: fx.Node = n.args[0]
        stale = _stale_alias(dest, n, order)
        if stale is not None:
            raise NeedsFunctionalization(n, stale)
        base = root.get(dest, dest)
        if base.op == "placeholder":
            kind, fqn = leaf_kind[base.name]
            if kind == "param":
                raise fail(_written_value(n), _PARAM_WRITE.format(fqn=fqn))
            if kind != "buffer":
                raise fail(n, f"forward writes in place into the {kind} {fqn!r}; only buffers "
                              "(and frozen parameters) may be updated by forward")
            updates[fqn] = n
        n.target = functional
        root[n] = base
    return updates


_PARAM_WRITE = (
    "forward writes in place into the trainable parameter {fqn!r} (e.g. "
    "`weight.data.clamp_()`); only buffers (and frozen parameters) may be updated by "
    "forward, as a parallelized step changes trainable parameters only by the optimizer. "
    "Constrain the parameter outside forward instead (after each optimizer step), or "
    "switch the write off for training (a model option)")


def _written_value(write: fx.Node) -> fx.Node:
    """The node that computed what ``write`` stores: for functionalization's
    ``copy_(param, value)`` the op the user called (``clamp`` of ``w.data.clamp_()``),
    which carries the user's line; else the write itself."""
    if write.target is not torch.ops.aten.copy_.default or len(write.args) < 2:
        return write
    value = write.args[1]
    while isinstance(value, fx.Node) and is_view_op(value.target) \
            and isinstance(value.args[0], fx.Node) and value.args[0].op == "call_function":
        value = value.args[0]              # through functionalization's aliases of the result
    return value if isinstance(value, fx.Node) and value.op == "call_function" else write


def _stale_alias(dest: fx.Node, write: fx.Node, order: dict) -> fx.Node | None:
    """A node that would read ``dest``'s storage as it was before ``write``, if any.

    ``dest``'s aliases are the nodes joined to it by view ops (up to the tensor it views,
    down to views of those). Once ``write`` becomes out-of-place, an alias read after it
    would miss the write; so would a leaf (parameter, buffer, input) that ``dest`` views.
    """
    family, stack = {dest}, [dest]
    while stack:
        node = stack.pop()
        related = [u for u in node.users if is_view_op(u.target)]
        if is_view_op(node.target) and isinstance(node.args[0], fx.Node):
            related.append(node.args[0])
        for other in related:
            if other not in family:
                family.add(other)
                stack.append(other)
    for member in family:
        if member is not dest and member.op == "placeholder":
            return member
        for user in member.users:
            if user is not write and order[user] > order[write]:
                return member
    return None


def retrace_functional(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` re-traced through ``torch.func.functionalize``: no writes into views remain.

    Runs on the fake values the first trace recorded, node by node (``fx.Interpreter``),
    so each new node inherits the module path, line, sequence number and phase marks of
    the node it comes from. The result takes and returns flat lists.
    """
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    args = [n.meta["val"] for n in placeholders]
    interpreter = fx.Interpreter(gm)

    def run(*flat):
        return interpreter.run(*flat, enable_io_processing=False)

    from torch.fx.traceback import preserve_node_meta
    fake_mode = detect_fake_mode(args)
    assert fake_mode is not None, "a captured graph's placeholders hold fake tensors"
    with preserve_node_meta(), fake_mode:
        return make_fx(torch.func.functionalize(run, remove="mutations"))(*args)
