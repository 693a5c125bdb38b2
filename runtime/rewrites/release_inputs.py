"""Programs that free each input after its last read: the backward's saved values.

A program called as ``program(*saved)`` cannot free what it was given: the call's argument
tuple holds every input until the program returns, so each value forward saved stays
allocated through the whole backward, while eager autograd frees a saved tensor once the
backward op that reads it has run. On a ResNet that is most of the activations held twice
as long as the plan's memory estimate assumes (``passes/pricing/memory.py``: every value
freed after its last reader, as the generated code of an FX program frees its own).

``release_inputs`` makes a program take its inputs as one list, which it empties once it
has bound them (the "boxed" calling convention of ``torch._functorch``'s compiled
backward): from then on the program's own variable is each input's last reference, and
FX's generated code drops it after its last reader. ``call_releasing`` calls any program
on a list of inputs this way, and as ``program(*inputs)`` where it takes them one by one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx
from torch.fx.graph import CodeGen

__all__ = ["release_inputs", "call_releasing", "TAKES_LIST"]

TAKES_LIST = "torchalpa_takes_input_list"
"""Attribute set on a program that takes its inputs as one list and empties it."""


class _ListCodeGen(CodeGen):
    """``def forward(self, inputs)``: binds the placeholders from the list, then clears it."""

    def gen_fn_def(self, free_vars, maybe_return_annotation, **_):
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        name = getattr(self, "_func_name", "forward")
        lines = [f"def {name}(self, inputs){maybe_return_annotation}:"]
        if names:
            lines.append(f"    ({', '.join(names)},) = inputs")
        lines.append("    inputs.clear()")
        return "\n".join(lines)


def release_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (changed in place, and returned) called as ``gm(inputs)`` with a list of its
    inputs, which it empties; each input is freed after its last reader in the program,
    unless the caller holds it elsewhere."""
    gm.graph.set_codegen(_ListCodeGen())
    gm.recompile()
    setattr(gm, TAKES_LIST, True)
    return gm


def call_releasing(program: Callable, inputs: list):
    """``program`` on ``inputs``, the list emptied: a program made by ``release_inputs``
    (or an object with ``call_list``) frees each input after its last read; any other
    program holds them all until it returns, as ``program(*inputs)`` does."""
    call_list = getattr(program, "call_list", None)
    if call_list is not None:
        return call_list(inputs)
    if getattr(program, TAKES_LIST, False):
        return program(inputs)
    values = tuple(inputs)
    inputs.clear()
    return program(*values)
