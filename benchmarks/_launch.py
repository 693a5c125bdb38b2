"""What the side-by-side benchmarks share: their common flags, the torchrun launcher (inside
``shared/tools/netns_bytes.sh`` when run as root, so loopback bytes are the job's own), the
order methods run in, and how each rank's measurements are gathered into one JSON result.

A benchmark script runs twice: as the launcher (``launch``), which starts torchrun on the
same script with ``--worker PATH``, and as each rank (its own worker function), which
measures and has rank 0 write the JSON result to PATH for the launcher to report.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# shared/ sits beside the checkout (/work/main) or two levels up (a worktree, /work/wt/x)
NETNS = next((p for p in (os.path.join(ROOT, *[".."] * up, "shared", "tools", "netns_bytes.sh")
                          for up in (1, 2)) if os.path.exists(p)), "netns_bytes.sh")

__all__ = ["add_run_args", "launch", "method_order", "average_runs", "peak_over_ranks",
           "describe_plan"]


def add_run_args(p: argparse.ArgumentParser, *, steps: int) -> None:
    """--steps, --rounds, --nproc and the hidden --worker every benchmark takes."""
    p.add_argument("--steps", type=int, default=steps, help="steps per method, the first untimed")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the methods this many times, in alternating order (A B C, C B A, "
                        "...), and average: load drifting on a shared machine hits all alike")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)   # JSON path, in torchrun


def launch(script: str, flags: list[str], *, nproc: int, port: int) -> dict:
    """Run ``script`` under torchrun on ``nproc`` local gloo ranks with ``flags`` and a
    ``--worker`` path, and return the JSON its rank 0 wrote there. Exits with the job's
    output on failure."""
    out = os.path.join(tempfile.mkdtemp(), "result.json")
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                "--master_addr=127.0.0.1", f"--master_port={port}", os.path.abspath(script),
                *flags, "--worker", out]
    in_netns = os.path.exists(NETNS) and os.geteuid() == 0
    if not in_netns:
        print("warning: not inside shared/tools/netns_bytes.sh (missing, or not root); "
              "loopback bytes will include other local traffic", file=sys.stderr)
    cmd = ["bash", NETNS, *torchrun] if in_netns else torchrun
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHALPA_TIMEOUT_S="1800")
    env.setdefault("TORCHALPA_LOG", "warning")
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True)
    if proc.returncode != 0:
        sys.exit(f"the benchmark failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    with open(out) as f:
        return json.load(f)


def method_order(methods, round_index: int) -> list[str]:
    """The methods in the order of round ``round_index``: as given, then reversed, ..."""
    return list(methods) if round_index % 2 == 0 else list(reversed(methods))


def average_runs(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per method, its last run's record with step time and loopback bytes averaged over
    the rounds, the largest peak memory, and each round's step time."""
    out = {}
    for name, rs in runs.items():
        out[name] = dict(rs[-1])
        for key in ("step_s", "loopback_bytes_per_step"):
            out[name][key] = sum(r[key] for r in rs) / len(rs)
        out[name]["peak_bytes"] = max(r["peak_bytes"] for r in rs)
        out[name]["step_s_per_round"] = [r["step_s"] for r in rs]
    return out


def peak_over_ranks() -> int:
    """The largest peak resident memory of any rank (collective)."""
    import torch
    import torch.distributed as dist

    from torchalpa.runtime.measure import peak_memory_bytes
    peak = torch.tensor([peak_memory_bytes()], dtype=torch.int64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def describe_plan(plan) -> str:
    """Mesh, parameter layouts, the collectives one step issues (buckets counted once) and
    the estimated step time."""
    from torchalpa.runtime.buckets import issued_collectives
    layouts: dict[str, int] = {}
    for v in plan.parameters:
        key = "".join(str(p) for p in v.placements)
        layouts[key] = layouts.get(key, 0) + 1
    kinds: dict[str, int] = {}
    for c in issued_collectives(plan):
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    return (f"mesh {list(plan.mesh_shape)}, layouts {layouts}, collectives {kinds}, "
            f"est {plan.estimates['step_time_s'] * 1e3:.3g} ms")
