"""A backward program that adds each raw gradient into the step's running sum as it is made.

With several micro-batches a step sums each parameter's raw gradient over them and
reshards the sum once (``runtime/execution/step.py``). Summed after the backward program
returns, every gradient of the micro-batch is alive beside the sum at once: the raw
gradients' bytes twice (on a ZeRO stage, whole over the data-parallel axis: 2 x 2.8 GiB
on Alpa's GPT-2.6B stage). ``add_into_sums(gm, num_grads)`` makes a copy of a backward
program that takes the running sums after its own inputs and adds each gradient into its
sum (``aten.add_``) right after the op that makes it, returning the sums in the
gradients' places; the generated code drops the gradient there, so one gradient at a time
is alive beside the sums, as XLA's accumulation into a donated buffer holds it (Alpa's
``compute_grad_to_accumulate_grad``). The same values, bit for bit: ``sum + g`` either way.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

__all__ = ["add_into_sums"]


def add_into_sums(gm: fx.GraphModule, num_grads: int, start: bool = False) -> fx.GraphModule:
    """A copy of backward program ``gm`` (``(*inputs) -> (*raw gradients, *sends)``, the
    first ``num_grads`` outputs gradients or None) as ``(*inputs, *sums) -> (*sums,
    *sends)``: one sum per gradient that is not None, in order, each added into in place
    right after its gradient is made. ``start``: the first micro-batch's, ``(*inputs) ->
    (*sums, *sends)``, each sum a fresh copy of its gradient made right after it (the
    step's own tensors, which the later micro-batches add into in place: a gradient the
    program returns may share its storage with an input)."""
    graph = copy.deepcopy(gm.graph)
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    for i in range(num_grads):
        if outs[i] is not None and not isinstance(outs[i], fx.Node):
            raise ValueError(f"backward output {i} is {outs[i]!r}, not a value the program "
                             "makes: its gradients cannot be summed inside it")
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    sums = {}
    for i in range(num_grads):
        if outs[i] is not None and not start:
            with graph.inserting_after(last):
                last = sums[i] = graph.placeholder(f"grad_sum_{i}")
    for i in range(num_grads):
        g = outs[i]
        if g is None:
            continue
        with graph.inserting_after(last if g.op == "placeholder" else g):
            outs[i] = graph.call_function(torch.ops.aten.clone.default, (g,), {
                "memory_format": torch.contiguous_format}) if start else \
                graph.call_function(torch.ops.aten.add_.Tensor, (sums[i], g))
    output.args = (tuple(outs),)
    graph.lint()
    return fx.GraphModule(gm, graph)
