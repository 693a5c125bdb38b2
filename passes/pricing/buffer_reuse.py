"""Op results that are written into an operand's buffer: no storage of their own.

The captured step is functional, so a write eager makes into a buffer it has just made
(``nll_loss_backward``'s scatter into its zeros, an embedding's backward adding rows into
a zeroed gradient) is an out-of-place op there: ``scatter(full_like(x), ...)``. Priced as
captured, the zeros and the scatter's result are both alive at the scatter -- on a
large-vocabulary loss two float32 tensors of tokens x vocabulary (9.2 GiB each for one
micro-batch of MPT-760M) where eager holds one. The runtime runs such an op in place
where nothing reads its first operand afterwards (``runtime/rewrites/write_in_place.py``);
``in_place_root`` says, with the same rule, which storage the result then is, so
``memory.liveness`` extends that storage's interval as it does for a view.

The rule (the runtime's, on its programs): the op is an out-of-place form of an in-place
op (``core/inplace_forms.IN_PLACE_FORMS``); its first operand's storage is an op's only
result, of the same phase (so the same program: forward and backward run apart; not a parameter,
a buffer or an input, which others hold), of the result's shape and dtype, with no view
of it anywhere (the operand itself not a view), that no other operand of the op reads and
nothing reads after it (not the step's outputs, not a value kept for a later op). A chain
of such writes (a scatter into a scatter's result) is one storage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torchalpa.core.inplace_forms import IN_PLACE_FORMS
from torchalpa.core.opgraph import OpGraph, OpNode, ValueRef

__all__ = ["in_place_root"]


def in_place_root(graph: OpGraph, node: OpNode, roots: Mapping[str, ValueRef],
                  sharing: Mapping[ValueRef, Sequence[str]],
                  last_use: Mapping[tuple[str, int], int], order: Mapping[str, int],
                  never_held: frozenset[str] | set[str] = frozenset()) -> ValueRef | None:
    """The storage ``node``'s result is written into (module doc), or None when it needs
    one of its own. ``roots``: the values found so far that share another's storage (view
    or in-place result) -> that storage; ``sharing``: storage -> those values;
    ``last_use``: (value, result) -> the last point that reads it (the step's outputs and
    kept values included); ``never_held``: values that allocate nothing (fused)."""
    if node.op not in IN_PLACE_FORMS or not node.operands or len(node.outputs) != 1:
        return None
    base = node.operands[0]
    root = roots.get(base.node, base)
    made = graph.node(root.node)
    if made.kind != "op" or len(made.outputs) != 1 or made.phase != node.phase or \
            root.node in never_held:
        return None
    if graph.node(base.node).aliases or \
            any(graph.node(name).aliases for name in sharing.get(root, ())):
        return None     # a view of the buffer: writing into it would change what it reads
    held, out = graph.spec(root), node.outputs[0]
    if held.shape != out.shape or held.dtype != out.dtype:
        return None
    if any(roots.get(ref.node, ref) == root for ref in node.operands[1:]):
        return None
    at = order[node.name]
    reads = [last_use.get((root.node, root.index), at)]
    reads += [last_use.get((name, k), order[name]) for name in sharing.get(root, ())
              for k in range(len(graph.node(name).outputs))]
    return root if max(reads) <= at else None
