"""The quickstart MLP on 4 gloo ranks: torchalpa next to DDP and FSDP2, in one run.

    python benchmarks/quickstart_vs_ddp.py [--dim 1024 --batch 1024 --layers 10] [--check]

Runs examples/quickstart.py under torchrun inside shared/tools/netns_bytes.sh (a private
network namespace), so the loopback bytes per step are exactly what the ranks exchanged.
Prints model-state bytes per rank, step time and bytes per step for each method, their
ratios to DDP, and torchalpa's planned bytes next to the measured ones. ``--check`` fails
unless torchalpa holds at most 1/3 of DDP's model state and sends at most 1/3 of its bytes.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETNS = os.path.join(ROOT, "..", "shared", "tools", "netns_bytes.sh")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    out = os.path.join(tempfile.mkdtemp(), "quickstart.json")
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
                "--master_addr=127.0.0.1", "--master_port=29531",
                os.path.join(ROOT, "examples", "quickstart.py"), "--dim", str(args.dim),
                "--batch", str(args.batch), "--layers", str(args.layers),
                "--steps", str(args.steps), "--compare", "ddp", "fsdp2", "--json", out]
    in_netns = os.path.exists(NETNS) and os.geteuid() == 0
    cmd = ["bash", NETNS, *torchrun] if in_netns else torchrun
    if not in_netns:
        print("warning: shared/tools/netns_bytes.sh needs root; loopback bytes will include "
              "other local traffic", file=sys.stderr)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True)
    if proc.returncode != 0:
        sys.exit(f"quickstart failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    total = [l for l in proc.stdout.splitlines() if l.startswith("lo_bytes")]
    result = json.load(open(out))
    stats = result["stats"]
    ddp = stats["ddp"]
    print(f"quickstart MLP dim {args.dim}, batch {args.batch}, {args.layers} layers, "
          f"{result['world_size']} gloo ranks, {args.steps} steps (first one untimed)")
    print(f"{'method':<10}{'state/rank MiB':>16}{'x DDP':>7}{'step ms':>10}{'x DDP':>7}"
          f"{'loopback/step MiB':>19}{'x DDP':>7}")
    for name, s in stats.items():
        print(f"{name:<10}{s['state'] / 2**20:>16.1f}{s['state'] / ddp['state']:>7.2f}"
              f"{s['step_s'] * 1e3:>10.0f}{s['step_s'] / ddp['step_s']:>7.2f}"
              f"{s['loopback_bytes_per_step'] / 2**20:>19.1f}"
              f"{s['loopback_bytes_per_step'] / ddp['loopback_bytes_per_step']:>7.2f}")
    ta = stats["torchalpa"]
    print(f"torchalpa planned {ta['planned_wire_bytes_per_step'] / 2**20:.1f} MiB per step, "
          f"measured {ta['loopback_bytes_per_step'] / 2**20:.1f} MiB; parameters after one step "
          f"within {ta['max_param_diff_after_1_step']:.1e} of single-device training")
    if total:
        print(f"whole run on loopback (netns_bytes.sh): {int(total[-1].split()[1]) / 2**20:.0f} MiB")
    if args.check:
        assert ta["state"] <= ddp["state"] / 3, "model state above 1/3 of DDP's"
        assert ta["loopback_bytes_per_step"] <= ddp["loopback_bytes_per_step"] / 3, \
            "bytes per step above 1/3 of DDP's"
        print("check passed: model state and bytes per step each at most 1/3 of DDP's")


if __name__ == "__main__":
    main()
