"""Slices that cut one value into equal pieces read as one split, as ATen has it.

torch-mlir (and JAX's ``jnp.split``) write ``q, k, v = x.split(H, dim=-1)`` as three
``stablehlo.slice`` ops of the same value, one per piece. Read one by one, each slice cuts
its dim at fixed positions, so the dim can never be split across devices, and a fused q/k/v
projection splits by heads only through all-to-alls. Read together as
``aten.split_with_sizes`` (what the torch frontend sees), the split's rule may hold the
whole dim as a strided shard: every device its heads of q, of k and of v
(``passes/sharding/strides.py``). The gradient side is already one ``concatenate`` (``aten.cat``).

Only an exact tiling is merged: 2-8 slices of the same value along the same dim, step 1,
equal sizes, covering the dim once, every other dim whole. The split is priced as the
slices were (their bytes and flops summed): only the choices change, not the costs.
"""

from __future__ import annotations

from dataclasses import replace

from torchalpa.core.opgraph import Operand, OpNode, ValueRef

__all__ = ["equal_slices_as_split"]

_SLICE = "aten.slice.Tensor"
_MAX_PIECES = 8


def equal_slices_as_split(nodes: list[OpNode], spec_of, keep: set[str]) -> list[OpNode]:
    """``nodes`` with each exact tiling by equal slices replaced by one split at the first
    slice's place; readers of the slices read the split's results. ``spec_of(ref)`` is the
    spec of a value; slices named in ``keep`` (program outputs) stay."""
    groups: dict[tuple[ValueRef, int], list[OpNode]] = {}
    for n in nodes:
        if n.op == _SLICE and len(n.operands) == 1 and len(n.args) == 5 and n.args[4] == 1 \
                and n.name not in keep:
            groups.setdefault((n.operands[0], n.args[1]), []).append(n)
    renamed: dict[str, ValueRef] = {}
    splits: dict[str, OpNode] = {}      # first slice's name -> the split replacing the group
    dropped: set[str] = set()
    for (source, dim), slices in groups.items():
        whole = spec_of(source)
        ordered = sorted(slices, key=lambda n: n.args[2])
        size = whole.shape[dim] // max(len(ordered), 1)
        tiles = [(n.args[2], n.args[3]) for n in ordered]
        if not 2 <= len(ordered) <= _MAX_PIECES or \
                tiles != [(i * size, (i + 1) * size) for i in range(len(ordered))] or \
                size * len(ordered) != whole.shape[dim]:
            continue
        first = min(slices, key=nodes.index)
        split = OpNode(name=f"split_with_sizes_{first.name}", op="aten.split_with_sizes.default",
                       operands=(source,), args=(Operand(0), tuple([size] * len(ordered)), dim),
                       outputs=tuple(n.outputs[0] for n in ordered),
                       flops=sum(n.flops for n in ordered), bytes=sum(n.bytes for n in ordered),
                       aliases=all(n.aliases for n in ordered), module=first.module,
                       phase=first.phase,
                       source=first.source, stack=first.stack)
        splits[first.name] = split
        for i, n in enumerate(ordered):
            renamed[n.name] = ValueRef(split.name, i)
            dropped.add(n.name)
    if not splits:
        return nodes
    out = []
    for n in nodes:
        if n.name in splits:
            out.append(splits[n.name])
        if n.name in dropped:
            continue
        operands = tuple(renamed.get(r.node, r) if r.index == 0 else r for r in n.operands)
        out.append(n if operands == n.operands else replace(n, operands=operands))
    return out
