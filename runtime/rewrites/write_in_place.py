"""Writes into a buffer nothing reads afterwards, made in place as eager makes them.

The captured step is functional: ``nll_loss_backward``'s zeros and its scatter into them
come out as ``scatter(full_like(x), ...)``, whose out-of-place kernel copies the zeros
into a second buffer before scattering. Where the program's own op made the first
operand, nothing else reads it after the write and no view of it exists, this pass calls
the in-place op instead (``core/inplace_forms.IN_PLACE_FORMS``): one buffer, as eager
holds, and the values bit for bit the same (the out-of-place kernel is a copy followed by
the in-place one). The memory model prices the result as that buffer with the same rule
(``passes/pricing/buffer_reuse.py``).

Run on each program apart (forward, backward), after the split: a value one program
makes and another reads is an input there, which this leaves alone.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from torchalpa.core.inplace_forms import IN_PLACE_FORMS

__all__ = ["write_in_place"]


def _aten(name: str) -> object:
    """``torch.ops.aten.<op>.<overload>`` of a name ``aten.<op>.<overload>``."""
    _, op, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, op), overload)


_FORMS = {_aten(functional): _aten(in_place) for functional, in_place in IN_PLACE_FORMS.items()}
_WRITES = frozenset(_FORMS.values())


def _aliases(node: fx.Node) -> bool:
    """Whether ``node``'s result may share another tensor's storage: its schema says so,
    or it is no ATen op (a placeholder, an output, a Python call, a collective's wait,
    whose result is the collective's buffer though its schema does not say so)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or \
            getattr(node.target, "namespace", None) != "aten":
        return True
    return any(r.alias_info is not None for r in schema.returns)


def _writable(base: object, node: fx.Node, position: dict[fx.Node, int]) -> bool:
    """Whether ``node`` may write into ``base``: a result of this program's own op that
    holds a buffer of its own (or one this pass already writes into), read by nothing
    after ``node`` and by no view, and no other argument of ``node``."""
    if not isinstance(base, fx.Node) or base.op != "call_function":
        return False
    if _aliases(base) and base.target not in _WRITES:
        return False
    for user in base.users:
        if user is node:
            continue
        if user.op == "output" or position[user] > position[node] or _aliases(user):
            return False
    others = [*node.args[1:], *node.kwargs.values()]
    return not any(a is base for a in others)


def write_in_place(program: fx.GraphModule, keep: frozenset[fx.Node] = frozenset()) -> int:
    """Make each functional write of ``IN_PLACE_FORMS`` whose first operand ``_writable``
    allows in place, in ``program``'s graph; recompile; return how many. Nodes in ``keep``
    stay as they are."""
    graph = program.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    made = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _FORMS or node in keep:
            continue
        base = node.args[0] if node.args else None
        if base in keep or not _writable(base, node, position):
            continue
        node.target = _FORMS[node.target]
        made += 1
    if made:
        program.recompile()
    return made
