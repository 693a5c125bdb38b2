"""What autograd's handling of DTensor gradients costs around a step, on one CPU process.

    python benchmarks/dtensor_grad_glue.py [--params 128] [--steps 50]

The README's loop hands each parameter its gradient through an autograd function whose
inputs are the DTensor parameters (``runtime/execution/module.py``): autograd then wraps,
checks and accumulates DTensor gradients, where DDP's are plain tensors. Here an autograd
function over ``--params`` replicated DTensor parameters (the 64-layer MLP's shapes,
256 x 64 and 256) returns ready gradients, and the same over plain parameters; printed:
the main thread's CPU time of ``apply`` and of ``backward()`` (median over ``--steps``), and
of the pieces: wrapping the local gradients as DTensors and ``detach`` of each (what
AccumulateGrad does to a gradient it keeps). One gloo rank, one thread.
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import benchmark_process, median_time, parser
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor


class _Step(torch.autograd.Function):
    """d(loss)/d(parameter) = the prepared gradient, wrapped like its parameter."""

    @staticmethod
    def forward(ctx, grads, *params):
        ctx.grads = grads
        ctx.specs = [p._spec if isinstance(p, DTensor) else None for p in params]
        return torch.zeros(())

    @staticmethod
    def backward(ctx, *_):
        grads, ctx.grads = ctx.grads, None      # held by autograd alone: kept, not copied
        return (None, *[g if s is None else DTensor(g, s, requires_grad=False)
                        for g, s in zip(grads, ctx.specs)])


def _cpu_ms(f, steps: int) -> float:
    return median_time(f, steps, clock=time.thread_time) * 1e3


def main():
    p = parser(__doc__)
    p.add_argument("--params", type=int, default=128)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    with benchmark_process(group="one"):
        measure(args)


def measure(args):
    mesh = init_device_mesh("cpu", (1,))
    shapes = [(256, 64) if i % 2 == 0 else (256,) for i in range(args.params)]
    dparams = [torch.nn.Parameter(distribute_tensor(torch.randn(s), mesh, [Replicate()]))
               for s in shapes]
    plain = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for name, params in (("DTensor", dparams), ("plain", plain)):
        fwd, bwd = [], []
        for _ in range(args.steps):
            grads = [torch.ones(s) for s in shapes]     # fresh: AccumulateGrad keeps them
            t0 = time.thread_time()
            loss = _Step.apply(grads, *params)
            t1 = time.thread_time()
            del grads
            loss.backward()
            fwd.append(t1 - t0)
            bwd.append(time.thread_time() - t1)
            for q in params:
                q.grad = None
        print(f"{args.params} {name} parameters: apply {statistics.median(fwd) * 1e3:.2f} ms, "
              f"backward {statistics.median(bwd) * 1e3:.2f} ms (CPU, median)")
    grads = [torch.ones(s) for s in shapes]
    wrapped = [DTensor(g, q._spec, requires_grad=False) for g, q in zip(grads, dparams)]
    print(f"  wrap {args.params} local gradients as DTensors: "
          f"{_cpu_ms(lambda: [DTensor(g, q._spec, requires_grad=False) for g, q in zip(grads, dparams)], args.steps):.2f} ms; "  # noqa: E501
          f"detach each: DTensor {_cpu_ms(lambda: [g.detach() for g in wrapped], args.steps):.2f}"
          f" ms, plain {_cpu_ms(lambda: [g.detach() for g in grads], args.steps):.2f} ms")


if __name__ == "__main__":
    main()
