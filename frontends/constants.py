"""Tensors a forward creates from Python values become ops, not hidden attributes.

``make_fx`` records a tensor whose value it knows at trace time (``torch.tensor(2.0)``,
the empty key/value tensors of a HuggingFace ``DynamicCache``, a table built with
``torch.tensor([...])`` inside forward) as a ``get_attr`` of a constant held by the graph
module, often followed by ``lift_fresh_copy``. The OpGraph has no such leaf, and a plan
could not place it, so ``inline_constants`` rewrites each constant as an op that makes it:

- an empty tensor: ``aten.empty.memory_format`` (it holds no value);
- every element equal (scalars included): ``aten.full.default``; like every factory, any
  layout is free and each device makes its own block;
- other values: ``torchalpa.constant.default`` (a custom op holding the values), made
  whole on every device like ``arange``. Only small constants are inlined this way: a
  large one belongs in a buffer (``register_buffer(..., persistent=False)``), which the
  plan can shard and the runtime keeps on device; the error says so.

Every rank builds the same values, so the program stays the same on every device type
(the device argument is rewritten to the rank's device like any factory's).
"""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["inline_constants", "CONSTANT_OP", "MAX_INLINE_ELEMENTS", "LargeConstant"]

CONSTANT_OP = "torchalpa.constant.default"
MAX_INLINE_ELEMENTS = 4096

aten = torch.ops.aten


class LargeConstant(ValueError):
    """A constant too big to inline; ``node`` is the first op that reads it."""

    def __init__(self, node: fx.Node, numel: int):
        super().__init__(numel)
        self.node, self.numel = node, numel


@torch.library.custom_op("torchalpa::constant", mutates_args=())
def _constant(shape: list[int], dtype: torch.dtype, device: torch.device,
              floats: list[float], ints: list[int]) -> torch.Tensor:
    values = floats if dtype.is_floating_point or dtype.is_complex else ints
    return torch.tensor(values, dtype=dtype, device=device).reshape(shape)


@_constant.register_fake
def _(shape, dtype, device, floats, ints):
    return torch.empty(shape, dtype=dtype, device=device)


def _uniform_value(value: torch.Tensor):
    """The one value every element holds, or None."""
    flat = value.detach().reshape(-1)
    first = flat[0]
    if bool((flat == first).all()) or (value.dtype.is_floating_point
                                       and bool(torch.isnan(flat).all())):
        return first.item()
    return None


def inline_constants(gm: fx.GraphModule) -> None:
    """Replace every tensor ``get_attr`` of ``gm`` with an op that makes it (in place)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
            continue
        value = value.detach()
        shape, dtype = list(value.shape), value.dtype
        kwargs = dict(dtype=dtype, device=value.device)
        with graph.inserting_before(node):
            if value.numel() == 0:
                made = graph.call_function(aten.empty.memory_format, (shape,),
                                           dict(kwargs, pin_memory=False))
            elif (fill := _uniform_value(value)) is not None:
                made = graph.call_function(aten.full.default, (shape, fill),
                                           dict(kwargs, pin_memory=False))
            elif value.numel() <= MAX_INLINE_ELEMENTS:
                as_list = value.reshape(-1).tolist()
                floats = as_list if dtype.is_floating_point else []
                ints = [] if dtype.is_floating_point else [int(v) for v in as_list]
                made = graph.call_function(torch.ops.torchalpa.constant.default, (shape,),
                                           dict(kwargs, floats=floats, ints=ints))
            else:
                raise LargeConstant(next(iter(node.users), node), value.numel())
        made.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        made.meta["val"] = _fake_like(node, value)
        node.replace_all_uses_with(made)
        graph.erase_node(node)
        if hasattr(gm, node.target):
            delattr(gm, node.target)
    _drop_fresh_copies(graph)
    gm.recompile()


def _fake_like(node: fx.Node, value: torch.Tensor):
    """The fake tensor the trace recorded for ``node`` (its users' args), else the value."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val
    for user in node.users:
        if user.target is aten.lift_fresh_copy.default and "val" in user.meta:
            return user.meta["val"]
    return value


def _drop_fresh_copies(graph: fx.Graph) -> None:
    """``lift_fresh_copy(op)`` of a freshly made tensor is that tensor: remove the copy."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.lift_fresh_copy.default:
            source = node.args[0]
            if isinstance(source, fx.Node) and source.op == "call_function" and (
                    source.target in (aten.empty.memory_format, aten.full.default,
                                      torch.ops.torchalpa.constant.default)):
                node.replace_all_uses_with(source)
                graph.erase_node(node)
