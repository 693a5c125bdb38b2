"""What the side-by-side benchmarks share: their common flags, and -- from
``torchalpa.cli.bench``, which ``torchalpa bench`` also runs on -- the torchrun launcher (inside
``shared/tools/netns_bytes.sh`` when run as root, so loopback bytes are the job's own), the
order methods run in, how each rank's measurements are gathered into one JSON result, and
how a worker writes it and leaves (``leave_with_result``).

A benchmark script runs twice: as the launcher (``launch``), which starts torchrun on the
same script with ``--worker PATH``, and as each rank (its own worker function), which
measures and has rank 0 write the JSON result to PATH for the launcher to report.
"""

from __future__ import annotations

import argparse
import sys

from torchalpa.cli import bench
from torchalpa.cli.bench import (
    average_runs,
    describe_plan,
    leave_with_result,
    method_order,
    peak_over_ranks,
)

__all__ = ["add_run_args", "launch", "method_order", "average_runs", "peak_over_ranks",
           "describe_plan", "leave_with_result"]


def add_run_args(p: argparse.ArgumentParser, *, steps: int) -> None:
    """--steps, --rounds, --nproc and the hidden --worker every benchmark takes."""
    p.add_argument("--steps", type=int, default=steps, help="steps per method, the first untimed")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the methods this many times, in alternating order (A B C, C B A, "
                        "...), and average: load drifting on a shared machine hits all alike")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)   # JSON path, in torchrun


def launch(script: str, flags: list[str], *, nproc: int, port: int) -> dict:
    """``torchalpa.cli.bench.launch``; exits with the job's output on failure."""
    try:
        return bench.launch(script, flags, nproc=nproc, port=port)
    except RuntimeError as e:
        sys.exit(str(e))
