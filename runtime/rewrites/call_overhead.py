"""Copies of a step's programs with less Python per op: what a lowered program costs per call.

A lowered program runs op by op from Python (eager's backward runs in C++), some 250-300
ATen calls per step for the zoo's small transformers, each paying Python dispatch on top
of its kernel. On a CPU, where the kernels of a small model take microseconds, that
dispatch is a large part of the step. ``cut_call_overhead`` makes the copy of a program
that a ``StepRunner`` runs eagerly (``runtime.rewrites.program_rewrites.step_programs``; the source programs
stay as lowered: printed by ``local_program()``, counted, profiled, traced by
``torch.compile``) with three rewrites, each leaving every value the same, bit for bit:

- ``fold_permute_pairs``: ``permute(permute(x, p), q)`` whose composition is the identity is
  ``x`` (the decomposed backward of a linear layer transposes its weight's gradient twice);
- ``fold_constants``: ops that read no input of the program (a causal mask: ``arange``,
  ``sub``, ``le``, ...; ``full``, ``scalar_tensor``) are computed once, when the program is
  built, and read as the program's buffers -- only deterministic, non-mutating ATen ops, up
  to ``MAX_CONSTANT_NUMEL`` elements, never a value the program returns (its caller may
  write to it) nor one an op of the program writes into (``write_in_place``'s zeros);
- ``direct_calls``: each ATen call goes straight to the operator's C++ entry instead of
  through ``OpOverload.__call__``'s Python frame (about 1 us a call on this CPU).
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
from torch.fx.node import map_arg

__all__ = ["cut_call_overhead", "fold_permute_pairs", "fold_constants", "direct_calls",
           "MAX_CONSTANT_NUMEL"]

aten = torch.ops.aten
MAX_CONSTANT_NUMEL = 1 << 16      # a constant is kept for the program's life: keep them small
_DIRECT = "torchalpa_direct"       # the module name FX prints for a direct call


def cut_call_overhead(gm: fx.GraphModule, read_only_from: int | None = None
                      ) -> fx.GraphModule:
    """A copy of ``gm`` with the three rewrites applied (``gm`` itself is left as it is);
    ``read_only_from``: as for ``fold_constants``."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = fx.GraphModule(gm, graph, type(gm).__name__)
    fold_permute_pairs(copy.graph)
    fold_constants(copy, read_only_from)
    direct_calls(copy.graph)
    copy.graph.lint()
    copy.recompile()
    return copy


def _returned(graph: fx.Graph, read_only_from: int | None) -> set[fx.Node]:
    """The values the program returns where its caller may write to them: every output
    before position ``read_only_from`` (all of them when None)."""
    out = next((n for n in graph.nodes if n.op == "output"), None)
    if out is None:
        return set()
    values = out.args[0]
    if read_only_from is None or not isinstance(values, (tuple, list)):
        return set(out.all_input_nodes)
    found: list[fx.Node] = []
    map_arg(values[:read_only_from], found.append)
    return set(found)


def fold_permute_pairs(graph: fx.Graph) -> int:
    """Replace ``permute(permute(x, p), q)`` by ``x`` where ``p`` then ``q`` is the identity
    (a view of ``x`` with its own sizes and strides: the same values, read the same way);
    returns how many."""
    folded = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not aten.permute.default or n.kwargs:
            continue
        inner = n.args[0]
        if not (isinstance(inner, fx.Node) and inner.op == "call_function"
                and inner.target is aten.permute.default and not inner.kwargs):
            continue
        p, q = inner.args[1], n.args[1]
        if not isinstance(p, (list, tuple)) or not isinstance(q, (list, tuple)):
            continue
        if len(p) != len(q) or any(p[q[i]] != i for i in range(len(q))):
            continue
        n.replace_all_uses_with(inner.args[0])
        graph.erase_node(n)
        if not inner.users:
            graph.erase_node(inner)
        folded += 1
    return folded


def _foldable(n: fx.Node) -> bool:
    """An ATen op whose result depends only on its arguments and that writes nothing."""
    target = n.target
    if n.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace != "aten" or target._schema.is_mutable \
            or target._opname.startswith(("empty", "new_empty")):    # uninitialized memory
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags


def _writes_into(user: fx.Node, value: fx.Node) -> bool:
    """Whether ``user`` writes into ``value`` (an argument its schema marks written, as
    ``scatter_``'s ``self``): such a value cannot be a buffer computed once."""
    schema = getattr(user.target, "_schema", None)
    if user.op != "call_function" or schema is None:
        return False
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        given = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
        if given is value:
            return True
    return False


def fold_constants(gm: fx.GraphModule, read_only_from: int | None = None) -> int:
    """Compute once the ops that read no program input, and read their results as buffers
    of ``gm`` where a computed op uses them; returns how many buffers were made. Outputs
    from position ``read_only_from`` on go only to readers (a forward's values saved for
    backward) and may be such buffers too; the others stay computed each call."""
    graph = gm.graph
    values: dict[fx.Node, torch.Tensor] = {}
    for n in graph.nodes:
        if not _foldable(n) or not all(i in values for i in n.all_input_nodes):
            continue
        value = n.target(*map_arg(n.args, values.__getitem__),
                         **map_arg(n.kwargs, values.__getitem__))
        if isinstance(value, torch.Tensor) and value.numel() <= MAX_CONSTANT_NUMEL:
            values[n] = value
    returned = _returned(graph, read_only_from)
    made = 0
    for n, value in values.items():
        if n in returned or all(u in values for u in n.users):
            continue      # returned (kept computed), or only read by other constants
        if any(_writes_into(u, n) for u in n.users):
            continue      # written in place (``write_in_place``): a fresh buffer each call
        name = f"_constant_{made}"
        while hasattr(gm, name):
            name += "_"
        gm.register_buffer(name, value)
        with graph.inserting_before(n):
            read = graph.get_attr(name)
        uses = [u for u in n.users if u not in values or u.op == "output"]
        for u in uses:
            u.replace_input_with(n, read)
        made += 1
    for n in reversed(list(values)):
        if not n.users:
            graph.erase_node(n)
    return made


@functools.cache
def _direct(op: torch._ops.OpOverload):
    """``op``'s C++ entry, callable without a Python frame, under a name FX can print
    (one per operator)."""
    call = functools.partial(op._op)
    call.__name__ = f"{op._opname}_{op._overloadname}"      # type: ignore[attr-defined]
    call.__module__ = _DIRECT                                # type: ignore[attr-defined]
    return call


def direct_calls(graph: fx.Graph) -> int:
    """Point every ATen call at its operator's C++ entry; returns how many."""
    changed = 0
    for n in graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                and n.target.namespace == "aten":
            n.target = _direct(n.target)
            changed += 1
    return changed
