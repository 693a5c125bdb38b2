"""A backward program that frees each saved activation at its last use, as autograd does.

Eager autograd releases what a node saved as soon as that node's backward has run, so
the gradients of the earlier layers reuse the memory of the later layers' activations.
A lowered backward program also drops each input after its last use (FX's generated code
sets it to None) -- but a Python call ``program(*saved)`` keeps every argument alive in
the caller's argument tuple until it returns. Every activation then lives to the end of
backward, and the gradients take fresh memory: on CPU, pages the allocator returned to
the system after the last step, faulted in again (a few thousand faults a step on the
64-layer MLP of ``benchmarks/loop_vs_ddp.py``; DDP's backward, none).

``boxed(gm)`` gives a program the boxed calling convention (``torch.fx``'s, as AOTAutograd
uses): it takes one list, moves its inputs out and empties it, so once its caller holds
no other reference to them each input is freed at its last use. Callers hand the list
over with ``rank_programs.EagerOrTraced.consume`` and keep nothing else (``StepRunner``
pops a micro-batch's saved values; the module's autograd function gives up its own).
"""

from __future__ import annotations

import torch.fx as fx
from torch.fx.graph import _BoxedCodeGen

__all__ = ["boxed"]


def boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (in place) called as ``gm(inputs)``, a list it empties."""
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm
