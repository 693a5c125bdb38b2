"""How much of a side stream's traffic hides behind matmuls on one GPU: the overlap the
estimate assumes, measured.

    python benchmarks/gpu_overlap.py                 # needs CUDA; about 20 s

The estimate (``passes/pricing/overlap_price.py``) prices communication on its own stream
beside compute, and offload (``passes/pricing/offload_price.py``) prices copies over the host
link. One GPU cannot run an NCCL collective between ranks, so this measures the two things
underneath that one GPU can show:

* **host link**: pinned host-to-device and device-to-host copies on a side stream, alone and
  beside a chain of bf16 matmuls: the link's bandwidth (against ``Cluster.detect()``'s
  ``host_link_bandwidth``) and the fraction of the copy time that stays exposed;
* **SM contention**: a device-to-device copy kernel on a side stream (the memory traffic an
  NCCL kernel makes, on SMs of its own) beside the same matmuls: how much the matmuls slow
  down, and the fraction of the copy exposed.

Each figure is the median of ``--repeats`` runs timed with CUDA events after a warm-up.
Exposed fraction = (both together - compute alone) / side work alone: 0 is fully hidden,
1 is serial.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def timed(work, repeats: int) -> float:
    """Median seconds of ``work()`` (which may use several streams), CUDA events on the
    current stream after waiting for every stream."""
    work()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        work()
        torch.cuda.synchronize()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--matmuls", type=int, default=24, help="bf16 8192^3 products in the chain")
    p.add_argument("--mib", type=int, default=1024, help="bytes copied on the side stream")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu_overlap.py needs CUDA; torch.cuda.is_available() is False",
              file=sys.stderr)
        return 2
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    count = args.mib * 2**20 // 4
    host_src = torch.empty(count, dtype=torch.float32, pin_memory=True)
    host_dst = torch.empty(count, dtype=torch.float32, pin_memory=True)
    dev_src = torch.randn(count, device="cuda")
    dev_dst = torch.empty(count, device="cuda")
    dev_big_src = torch.randn(4 * count, device="cuda")
    dev_big_dst = torch.empty(4 * count, device="cuda")
    side = torch.cuda.Stream()

    def compute():
        for _ in range(args.matmuls):
            torch.mm(a, b, out=out)

    def on_side(fn):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
        return run

    def both(fn):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            compute()
            torch.cuda.current_stream().wait_stream(side)
        return run

    sides = {
        "host->device (pinned)": lambda: dev_dst.copy_(host_src, non_blocking=True),
        "device->host (pinned)": lambda: host_dst.copy_(dev_src, non_blocking=True),
        "both directions": lambda: (dev_dst.copy_(host_src, non_blocking=True),
                                    host_dst.copy_(dev_src, non_blocking=True)),
        "device->device (32x bytes)": lambda: [dev_big_dst.copy_(dev_big_src) for _ in range(8)],
    }
    t_compute = timed(compute, args.repeats)
    flops = 2 * n**3 * args.matmuls
    print(f"{torch.cuda.get_device_name()}, PyTorch {torch.__version__}; median of "
          f"{args.repeats}; side copies of {args.mib} MiB")
    print(f"compute alone: {args.matmuls} bf16 {n}^3 matmuls, {t_compute * 1e3:.1f} ms "
          f"({flops / t_compute / 1e12:.0f} TFLOP/s)")
    try:
        from torchalpa import Cluster
        link = Cluster.detect().host_link_bandwidth
        print(f"planner's host link (Cluster.detect()): {link / 1e9:.1f} GB/s")
    except Exception as exc:  # the figure is a comparison only; the measurement stands alone
        print(f"planner's host link: not read ({type(exc).__name__}: {exc})")
    print(f"{'side stream':<28}{'alone ms':>10}{'GB/s':>8}{'together ms':>13}"
          f"{'exposed':>9}{'compute x':>11}")
    for label, fn in sides.items():
        t_side = timed(on_side(fn), args.repeats)
        t_both = timed(both(fn), args.repeats)
        moved = args.mib * 2**20 * (2 if label == "both directions" else 1)
        moved *= 32 if label.startswith("device->device") else 1
        exposed = (t_both - t_compute) / t_side
        print(f"{label:<28}{t_side * 1e3:10.1f}{moved / t_side / 1e9:8.1f}"
              f"{t_both * 1e3:13.1f}{exposed:9.2f}{t_both / t_compute:11.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
