"""Every op of a zoo model's training step timed alone on this GPU, beside the cost model's
price for it: where the step estimate is off, by op family.

    python benchmarks/op_times.py --model gpt2 --dtype bf16          # on a GPU
    python benchmarks/op_times.py --model gpt_small --device cpu     # a smoke run
    python benchmarks/op_times.py --model gpt2 --cluster h200 \
        --against benchmarks/gpu_logs/h200-2026-11-28/ops.log           # no GPU: re-price a log

The step is captured on the meta device (``one_gpu.py``'s configs; ``bf16`` through
``MixedPrecision`` as ``auto_parallel`` runs it) and each op priced for one device of the
detected cluster (``Cluster.detect``, with a stored ``torchalpa calibrate`` profile if
there is one), kernel time only (the host's per-op issue cost left out: CUDA events time
the device). Each distinct op (its name, operand shapes and dtypes, arguments) then runs
alone on random operands -- index operands zero, so every gather reads row 0 -- and its
device time is taken as CUDA events report it. Printed: per op family the count, the
estimated and measured milliseconds and their ratio; then the ops whose measured time
most exceeds the estimate. Ops that cannot run alone (random operands breaking an
invariant) are counted and named. Views move no data and are not timed.

``--against LOG`` times nothing: it prices the same ops with today's cost model and prints
each family's estimate beside the measured milliseconds of an earlier run's log (this
script's output on a GPU), so a change to the cost model is checked on a CPU.
"""

from __future__ import annotations

import argparse
import collections
import sys
from dataclasses import replace

import torch
from one_gpu import BENCHES, workload

import torchalpa
from torchalpa.core.opgraph import Operand
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel.calibrate_cuda import seconds_per_call
from torchalpa.parallel.workflow import calibrated
from torchalpa.passes.pricing.cost import compute_cost, op_family


def _materialize(spec, device: torch.device) -> torch.Tensor:
    dtype = getattr(torch, spec.dtype)
    if dtype.is_floating_point:
        return torch.randn(spec.shape, dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.rand(spec.shape, device=device) > 0.5
    return torch.zeros(spec.shape, dtype=dtype, device=device)


def _value(v, operands: list, device: torch.device):
    """An argument as the op takes it: operands substituted, dtypes and devices parsed."""
    if isinstance(v, Operand):
        return operands[v.k]
    if isinstance(v, (list, tuple)):
        return type(v)(_value(x, operands, device) for x in v)
    if isinstance(v, str) and v.startswith("torch."):
        return getattr(torch, v.removeprefix("torch."))
    if v == "meta":
        return device
    return v


def _callable(op: str):
    namespace, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def time_ops(graph, mesh, device: torch.device):
    """(family -> [count, estimated s, measured s], per-op rows, failed ops)."""
    kernel_mesh = replace(mesh, kernel_launch_s=0.0)
    families: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    cache: dict[tuple, float | None] = {}
    rows, failed = [], collections.Counter()
    for node in graph.ops():
        if node.aliases:
            continue
        specs = [graph.spec(ref) for ref in node.operands]
        key = (node.op, tuple((s.shape, s.dtype) for s in specs), repr(node.args),
               repr(node.kwargs))
        if key not in cache:
            try:
                operands = [_materialize(s, device) for s in specs]
                args = _value(node.args, operands, device)
                kwargs = {k: _value(v, operands, device) for k, v in node.kwargs}
                fn = _callable(node.op)
                cache[key] = seconds_per_call(lambda: fn(*args, **kwargs), device,
                                              calls=3, rounds=3, warmup=1)
            except Exception:  # an op that cannot run on random operands: named below
                cache[key] = None
        measured = cache[key]
        if measured is None:
            failed[node.op] += 1
            continue
        estimate = compute_cost(kernel_mesh, node, 1)
        entry = families[op_family(node.op)]
        entry[0] += 1
        entry[1] += estimate
        entry[2] += measured
        rows.append((measured - estimate, node.op, node.module, estimate, measured,
                     [s.shape for s in specs]))
    return families, rows, failed


def price_ops(graph, mesh):
    """family -> [count, estimated s] of the ops ``time_ops`` would time."""
    kernel_mesh = replace(mesh, kernel_launch_s=0.0)
    families: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for node in graph.ops():
        if not node.aliases:
            entry = families[op_family(node.op)]
            entry[0] += 1
            entry[1] += compute_cost(kernel_mesh, node, 1)
    return families


def against(log: str, graph, mesh) -> None:
    """Today's estimates per family beside the measured milliseconds in ``log``."""
    measured = {}
    for line in open(log):
        parts = line.split()
        if len(parts) == 5 and parts[1].isdigit():
            measured[parts[0]] = (int(parts[1]), float(parts[2]), float(parts[3]))
    print(f"{'family':<34}{'ops':>6}{'logged est':>11}{'est ms':>10}{'meas ms':>10}{'meas/est':>10}")
    total_e = total_m = 0.0
    for family, (count, est) in sorted(price_ops(graph, mesh).items(),
                                       key=lambda kv: -measured.get(kv[0], (0, 0, 0))[2]):
        if family not in measured:
            continue
        logged_count, logged_est, meas = measured[family]
        total_e, total_m = total_e + est * 1e3, total_m + meas
        flag = "" if logged_count == count else f"  (log: {logged_count} ops)"
        print(f"{family:<34}{count:>6}{logged_est:>11.3f}{est * 1e3:>10.3f}{meas:>10.3f}"
              f"{meas / (est * 1e3) if est else float('nan'):>10.3g}{flag}")
    print(f"{'all logged families':<34}{'':>6}{'':>11}{total_e:>10.3f}{total_m:>10.3f}"
          f"{total_m / total_e:>10.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", choices=list(BENCHES))
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--batch", type=int, help="batch size (default: the config's)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--top", type=int, default=20, help="most underpriced ops listed")
    p.add_argument("--cluster", help="price with this Cluster.preset (default: the detected "
                                     "GPU, calibrated if `torchalpa calibrate` ran)")
    p.add_argument("--against", metavar="LOG", help="time nothing: today's estimates beside "
                                                    "the measured column of LOG")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available() and not args.against:
        print("op_times.py times ops on a CUDA device; torch.cuda.is_available() is False "
              "(--device cpu runs it on this CPU, for a smoke run)", file=sys.stderr)
        sys.exit(2)
    bench = BENCHES[args.model]
    if args.batch:
        bench = replace(bench, batch_size=args.batch)
    w = workload(bench)
    with torch.device("meta"):
        model, batch = w.build(), w.example_inputs()
    if args.dtype == "bf16":
        from torchalpa.runtime.execution.precision import CastForward
        model = CastForward(model, torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    graph = capture(model, batch, w.loss_fn).graph
    if args.cluster or device.type != "cuda" or args.against:
        cluster = torchalpa.Cluster.preset(args.cluster or "h200", 1, 1)
    else:
        cluster = calibrated(torchalpa.Cluster.detect(1, 1))
    mesh = cluster.logical_mesh((1,))
    if args.against:
        print(f"{args.model} {args.dtype} batch {bench.batch_size} priced for {cluster.name} "
              f"today, beside the measured column of {args.against}")
        against(args.against, graph, mesh)
        return
    families, rows, failed = time_ops(graph, mesh, device)
    print(f"{args.model} {args.dtype} batch {bench.batch_size} on {device} "
          f"({cluster.name}); kernel times, host issue cost excluded")
    print(f"{'family':<34}{'ops':>6}{'est ms':>10}{'meas ms':>10}{'meas/est':>10}")
    total_e = total_m = 0.0
    for family, (count, est, meas) in sorted(families.items(), key=lambda kv: -kv[1][2]):
        total_e, total_m = total_e + est, total_m + meas
        print(f"{family:<34}{count:>6}{est * 1e3:>10.3f}{meas * 1e3:>10.3f}"
              f"{meas / est if est else float('nan'):>10.3g}")
    print(f"{'all timed ops':<34}{sum(f[0] for f in families.values()):>6}"
          f"{total_e * 1e3:>10.3f}{total_m * 1e3:>10.3f}{total_m / total_e:>10.3g}")
    if failed:
        print(f"not timed (could not run alone): {dict(failed)}")
    print(f"\nops most underpriced (measured - estimated), top {args.top}:")
    for gap, op, module, est, meas, shapes in sorted(rows, reverse=True)[:args.top]:
        print(f"  {gap * 1e6:9.1f} us  {op:<40} {module[-30:]:<30} est {est * 1e6:8.1f} "
              f"meas {meas * 1e6:8.1f}  {shapes}")


if __name__ == "__main__":
    main()
