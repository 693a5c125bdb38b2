"""Walking a captured joint graph: which nodes a set of results depends on.

The forward phase of a joint forward+backward graph is what the loss and the buffer
updates depend on; the capture and the activation-checkpointing passes all ask it.
"""

from __future__ import annotations

import torch.fx as fx

__all__ = ["ancestor_names"]


def ancestor_names(roots: list[fx.Node]) -> set[str]:
    """Names of the nodes ``roots`` depend on (themselves included)."""
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        stack.extend(n.all_input_nodes)
    return seen
