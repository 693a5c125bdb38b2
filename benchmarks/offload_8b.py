"""LLaMA-3-8B full fine-tuning on one and two H100 80GB: plans that offload optimizer states.

    python benchmarks/offload_8b.py                      # 1 and 2 devices
    python benchmarks/offload_8b.py --devices 1 --batch 8 --seq 2048

Full fine-tuning in bf16 mixed precision with AdamW keeps float32 parameters, gradients
and two Adam states: 16 bytes per parameter, about 128 GB for 8 B parameters, more than
one device holds. AutoParallel with its defaults (offload weighed only when nothing fits
on the devices) plans it without processes on meta weights; each line says what it chose,
the estimated step, device memory, the offload's share of the step and the host memory it
takes per node (``Cluster.h100``: PCIe Gen5 host links, 2 TB of host memory per node), or
the refusal when nothing fits.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import torchalpa
import torchalpa.models as zoo

GB = 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    with torch.device("meta"):
        workload = zoo.llama3_8b(batch_size=args.batch, seq_len=args.seq)
        model = workload.build()
    batch = workload.example_inputs(device="meta")
    bf16 = torchalpa.MixedPrecision(param_dtype=torch.bfloat16)
    for n in args.devices:
        cluster = torchalpa.Cluster.h100(1, n)
        start = time.perf_counter()
        try:
            plan = torchalpa.plan(model, batch, workload.loss_fn, cluster=cluster,
                                  mixed_precision=bf16,
                                  method=torchalpa.AutoParallel(optimizer="adamw"))
        except ValueError as e:
            lines = str(e).splitlines()
            print(f"{n} x H100: refused: {lines[0]}" + (f" ... {lines[-1]}" if len(lines) > 1
                                                         else ""))
            continue
        est = plan.estimates
        offload = (f"offload {est.offload_s:.3g} s of the step, host memory "
                   f"{est.host_bytes_per_node / GB:.0f} GB per node"
                   if est.offload_s is not None else "no offload")
        print(f"{n} x H100, batch {args.batch} x {args.seq}: {time.perf_counter() - start:.0f} s "
              f"(load {os.getloadavg()[0]:.1f}) | {plan.method.get('name')}, "
              f"remat={plan.method.get('remat')}, "
              f"{plan.method.get('num_micro_batches', 1)} micro-batches | est "
              f"{est.step_time_s:.4g} s/step, {est.memory_per_device_bytes / GB:.1f} GB "
              f"per device | {offload}", flush=True)
        for note in plan.notes:
            if note.startswith(("AutoParallel", "offload")):
                print(f"    {note}")


if __name__ == "__main__":
    main()
