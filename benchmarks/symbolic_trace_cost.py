"""What tracing the step with the batch dim symbolic costs beside the fake trace capture does.

A check of the micro-batch derivation from one trace would trace the batch symbolically
(a number Python computes from ``x.shape[0]`` then stays an expression in the batch
symbol); this measures whether such a trace is cheaper than the second fake trace the
search does now. LLaMA-3-8B (``--layers``, default 2) on meta, its joint step (loss and
gradients) with the capture's op vocabulary (``opset.decompositions``), made by ``make_fx``
twice each way, alternately: ``tracing_mode="fake"`` as ``capture`` does, and the same with
dim 0 of the inputs dynamic (``ShapeEnv``; parameters static). The loss ends with
``/ (x.shape[0] * 3)``, a number from the batch. Prints each trace's CPU seconds, its fx
node count, the gradients it traced, and for the symbolic one the symbolic numbers in the graph, the ops reading
them, and the shape guards.

    OMP_NUM_THREADS=1 python benchmarks/symbolic_trace_cost.py [--layers 2]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.nn.utils.stateless import _reparametrize_module

import torchalpa.models as zoo
from torchalpa.frontends.opset import decompositions, device_neutral_kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    w = zoo.llama3_8b(batch_size=4, seq_len=512).replace(num_layers=args.layers)
    with torch.device("meta"):
        model = w.build()
    names = [k for k, _ in model.named_parameters()]
    x, y = w.example_inputs(device="meta")

    def joint(params, x, y):
        with _reparametrize_module(model, dict(zip(names, params))):
            loss = w.loss_fn(model(x), y) / (x.shape[0] * 3)
        return [loss, *torch.autograd.grad(loss, params, allow_unused=True)]

    params = [p.detach().requires_grad_(True) for _, p in model.named_parameters()]

    def fake():
        with device_neutral_kernels():
            return make_fx(joint, tracing_mode="fake", decomposition_table=decompositions(),
                           _allow_non_fake_inputs=True)(params, x, y), None

    def symbolic():
        env = ShapeEnv()
        mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)

        def faked(t, batch_dim):
            dims = [DimDynamic.DYNAMIC if batch_dim and i == 0 else DimDynamic.STATIC
                    for i in range(t.dim())]
            return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(
                dynamic_sizes=dims))
        state = [faked(p, False).requires_grad_(True) for p in params]
        with device_neutral_kernels():
            return make_fx(joint, tracing_mode="symbolic", decomposition_table=decompositions(),
                           )(state, faked(x, True), faked(y, True)), env

    print(f"LLaMA-3-8B, {args.layers} layers, batch 4 x 512, load {os.getloadavg()[0]:.1f}")
    for name, trace in [("fake", fake), ("symbolic", symbolic)] * 2:
        start = time.process_time()
        gm, env = trace()
        cpu = time.process_time() - start
        numbers = [n for n in gm.graph.nodes if n.op == "call_function"
                   and isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat))]
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        grads = sum(1 for g in out[1:] if g is not None)
        print(f"  {name:8s} {cpu:6.2f} s CPU, {len(gm.graph.nodes)} fx nodes, "
              f"{grads} of {len(params)} gradients, {len(numbers)} symbolic numbers")
        if env is not None:
            readers = sorted({str(u.target) for n in numbers for u in n.users})
            print(f"           read by {readers}; guards {[str(g.expr) for g in env.guards]}")


if __name__ == "__main__":
    main()
