"""Where a one-GPU plan's memory estimate goes: model states, the activation peak and what
is alive there, what forward keeps for backward, by op and by module.

    python benchmarks/memory_breakdown.py --model resnet --dtype fp32
    python benchmarks/memory_breakdown.py --model bert --dtype bf16 --top 15

The models and batches are ``one_gpu.py``'s (planned on the meta device, no GPU needed):
read the printed parts against a GPU run's peak (``one_gpu.py``'s "peak GiB") to find
what the estimate misses or adds. The activations are the memory model's own
(``passes/pricing/memory.py``: every op result alive from the op that makes it to its
last reader, in the step's order), on one device, so every value is whole.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GiB = 2**30


def parse_args():
    from one_gpu import BENCHES
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet", choices=list(BENCHES))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--top", type=int, default=10, help="rows per table (default 10)")
    p.add_argument("--held-saved", action="store_true",
                   help="also the peak if every value forward saves stayed alive until "
                        "backward ends (the runtime before its backward programs freed "
                        "their inputs as they read them)")
    return p.parse_args()


def captured(model: str, dtype: str):
    """The step's graph, as the plan captures it for one GPU (on ``meta``)."""
    from one_gpu import BENCHES, workload

    import torchalpa
    from torchalpa.frontends.torch_export import capture
    from torchalpa.runtime.execution.precision import CastForward
    w = workload(BENCHES[model])
    with torch.device("meta"):
        net, batch = w.build(), w.example_inputs()
    if dtype == "bf16":
        net = CastForward(net, torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    return capture(net, batch, w.loss_fn).graph


def _table(title: str, rows: dict, top: int) -> None:
    total = sum(rows.values())
    print(f"\n{title}: {total / GiB:.3f} GiB")
    for key, nbytes in sorted(rows.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {key:<48}{nbytes / GiB:9.3f}  {100 * nbytes / max(total, 1):5.1f} %")


def main():
    from torchalpa.core.placement import Replicate
    from torchalpa.passes.pricing.memory import (
        activation_timeline,
        forward_end,
        liveness,
        state_copies,
        value_bytes,
    )
    args = parse_args()
    graph = captured(args.model, args.dtype)
    outputs = {n.name: tuple((Replicate(),) for _ in n.outputs) for n in graph}
    live = liveness(graph)
    timeline = activation_timeline(graph, live, outputs, (1,))
    peak_at, end = int(np.argmax(timeline)), forward_end(graph)
    order = [n.name for n in graph]
    new_grads = np.zeros(len(timeline))
    for _, ref in graph.outputs.grads:
        new_grads[order.index(ref.node):] += graph.node(ref.node).outputs[ref.index].nbytes
    states = collections.Counter()
    for n in graph:
        copies = state_copies(graph, n.name, 2)
        if copies:
            kind = "parameters" if n.kind == "param" else "buffers"
            states[f"{kind} ({n.output.dtype})"] += n.output.nbytes
            if copies > 1:
                states["gradients"] += n.output.nbytes
                states["optimizer states (2, AdamW)"] += (copies - 2) * n.output.nbytes
    node = graph.node(order[min(peak_at, len(order) - 1)])
    print(f"{args.model} {args.dtype}: {len(order)} nodes, forward ends at {end}; "
          f"activation peak at {peak_at} ({node.phase} {node.op}, {node.module or '-'})")
    _table("model states", states, args.top)
    for title, t in (("alive at the activation peak", peak_at), ("alive where forward ends "
                                                                  "(kept for backward)", end)):
        by_op, by_module = collections.Counter(), collections.Counter()
        for i in live.alive(t):
            name, k = live.names[i], live.results[i]
            n = graph.node(name)
            nbytes = value_bytes(graph, name, outputs[name], (1,), result=k)
            label = n.op if k is None else f"{n.op}[{k}]"
            by_op[f"{label} ({n.phase})"] += nbytes
            by_module[n.module or n.kind] += nbytes
        _table(title + ", by op", by_op, args.top)
        _table(title + ", by module", by_module, args.top)
    print(f"\nestimate: {(sum(states.values()) + timeline.max()) / GiB:.3f} GiB "
          "(model states + activation peak)")
    if args.held_saved:
        held = _held_until_backward_ends(graph, live)
        held_timeline = activation_timeline(graph, held, outputs, (1,))
        print(f"with saved values held until backward ends: "
              f"{(sum(states.values()) + held_timeline.max()) / GiB:.3f} GiB; and the "
              f"step's new gradients beside the previous step's (train_step attaches them "
              f"after backward): "
              f"{(sum(states.values()) + (held_timeline + new_grads).max()) / GiB:.3f} GiB")
    print(f"the estimate with the new gradients beside the previous step's: "
          f"{(sum(states.values()) + (timeline + new_grads).max()) / GiB:.3f} GiB")


def _held_until_backward_ends(graph, live):
    """``live`` with every forward result that backward reads alive until the last op."""
    import dataclasses
    order = {n.name: i for i, n in enumerate(graph)}
    read = {(ref.node, ref.index) for n in graph if n.phase == "backward"
            for ref in n.operands if graph.node(ref.node).phase == "forward"
            or graph.node(ref.node).kind == "input"}
    roots = {}
    for n in graph.ops():           # a view read in backward holds its root
        if n.aliases and n.operands:
            base = n.operands[0]
            roots[n.name] = roots.get(base.node, (base.node, base.index))
    read |= {roots[v] for v, _ in read if v in roots}
    end = np.array(live.end)
    for i, (name, k) in enumerate(live.entries()):
        results = range(len(graph.node(name).outputs)) if k is None else [k]
        if any((name, r) in read for r in results):
            end[i] = max(end[i], len(order) - 1)
    return dataclasses.replace(live, end=end)


if __name__ == "__main__":
    main()
