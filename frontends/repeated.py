"""Find the repeated layers of a captured step, so passes can share one decision per kind.

A *block* is the subtree of a numbered child of a module list or sequential container:
the module path ``layers.3.mlp.down_proj`` lies in block ``("layers", 3)``,
``encoder.layer.11.attention`` in ``("encoder.layer", 11)``, ``h.0.attn`` in ``("h", 0)``.
A block's nodes are its ops (forward and backward, by the module path the frontend
recorded) and its parameters (by FQN). Two blocks of the same container are *identical*
when their node sequences match op by op: op name, phase, output shapes and dtypes,
non-tensor arguments, and where each operand comes from (the same position inside the
block, or outside it). Only identical blocks are tagged; a container whose blocks differ
(a ResNet stage whose first block downsamples) gets one block type per class of identical
blocks, named ``prefix``, ``prefix#1``, ... and blocks alike to no other stay untagged.

Pure: reads an OpGraph, returns data, changes nothing.
"""

from __future__ import annotations

from collections import defaultdict

from torchalpa.core.opgraph import OpGraph, OpNode, block_of

__all__ = ["find_repeated_blocks", "block_counts"]



def _node_block(node: OpNode) -> tuple[str, int] | None:
    if node.kind == "op":
        return block_of(node.module) if node.module else None
    if node.kind in ("param", "buffer") and node.target:
        return block_of(node.target.rsplit(".", 1)[0]) if "." in node.target else None
    return None


def _signature(nodes: list[OpNode]) -> tuple:
    """What must match for two blocks to be the same computation."""
    position = {n.name: i for i, n in enumerate(nodes)}
    sig = []
    for n in nodes:
        sources = tuple((position[r.node], r.index) if r.node in position else None
                        for r in n.operands)
        entry = (n.kind, n.op, n.phase, n.outputs, sources, n.args, n.kwargs,
                 n.target.rsplit(".", 1)[-1] if n.kind != "op" and n.target else None)
        try:
            hash(entry)
        except TypeError:
            entry = repr(entry)
        sig.append(entry)
    return tuple(sig)


def find_repeated_blocks(graph: OpGraph) -> dict[str, tuple[str, int]]:
    """Node name -> (block type, block index) for every node of an identical repeated block.

    Blocks whose node sequence matches no other block of their container are left out,
    so every tagged block type has at least two members.
    """
    members: dict[str, dict[int, list[OpNode]]] = defaultdict(lambda: defaultdict(list))
    for node in graph:
        where = _node_block(node)
        if where is not None:
            members[where[0]][where[1]].append(node)
    tags: dict[str, tuple[str, int]] = {}
    for prefix, blocks in members.items():
        if len(blocks) < 2:
            continue
        classes: dict[tuple, list[int]] = defaultdict(list)
        for index in sorted(blocks):
            classes[_signature(blocks[index])].append(index)
        repeated = [indices for indices in classes.values() if len(indices) >= 2]
        repeated.sort(key=lambda indices: indices[0])
        for k, indices in enumerate(repeated):
            block_type = prefix if k == 0 else f"{prefix}#{k}"
            for index in indices:
                for node in blocks[index]:
                    tags[node.name] = (block_type, index)
    return tags


def block_counts(tags: dict[str, tuple[str, int]]) -> dict[str, int]:
    """Block type -> how many blocks of it were found."""
    seen: dict[str, set[int]] = defaultdict(set)
    for block_type, index in tags.values():
        seen[block_type].add(index)
    return {block_type: len(indices) for block_type, indices in sorted(seen.items())}
