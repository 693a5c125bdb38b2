"""Bytes each gloo collective really puts on loopback, next to the ideal ring traffic.

    ../shared/tools/netns_bytes.sh torchrun --nproc_per_node=4 --master_addr=127.0.0.1 \
        benchmarks/collective_bytes.py [--mib 4]

The cost model's per-backend choices come from this: on gloo, reduce_scatter moves as
many bytes as all_reduce (it is implemented as one), so Cluster.local_cpu() says so.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from torchalpa.runtime.execution import collectives as C
from torchalpa.runtime.measurement.measure import loopback_bytes


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=float, default=4.0, help="bytes each rank contributes")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    group = init_device_mesh("cpu", (n,)).get_group(0).group_name
    x = torch.randn(int(args.mib * 2**20) // 4 // (n * n) * (n * n))
    B = x.numel() * 4
    # collective, call, ideal loopback bytes (all ranks together) for a ring algorithm
    cases = [
        ("all_reduce", lambda: C.all_reduce(x, "sum", group), 2 * (n - 1) * B),
        ("all_gather", lambda: C.all_gather(x, 0, n, group), (n - 1) * n * B),
        ("reduce_scatter", lambda: C.reduce_scatter(x, 0, "sum", n, group), (n - 1) * B),
        ("all_to_all", lambda: C.all_to_all(x.view(n, -1), 0, 1, n, group), (n - 1) * B),
    ]
    if rank == 0:
        print(f"{n} ranks, {B / 2**20:.2f} MiB contributed per rank")
        print(f"{'collective':<16}{'loopback MiB':>14}{'ideal ring MiB':>16}{'ratio':>8}")
    for name, call, ideal in cases:
        call()
        dist.barrier()
        before = loopback_bytes()
        for _ in range(args.repeat):
            call()
        dist.barrier()
        measured = (loopback_bytes() - before) / args.repeat
        if rank == 0:
            print(f"{name:<16}{measured / 2**20:>14.2f}{ideal / 2**20:>16.2f}{measured / ideal:>8.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
