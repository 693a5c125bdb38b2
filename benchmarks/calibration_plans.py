"""How much the measured CPU cluster moves a plan: one small job planned with every stored
calibration of this machine, the distinct plans counted.

On gloo ranks ``auto_parallel`` times the machine when its cache holds no figures
(``torchalpa.parallel.calibrate.measure_cluster``); each test session starts with an
empty cache and so measures again. This plans a transformer MLP block with dropout on a
2 x 2 mesh (``ShardParallel``) once per calibration file found under the given cache
roots and prints each distinct plan (its matmuls' output placements) with how many
calibrations gave it::

    OMP_NUM_THREADS=1 python benchmarks/calibration_plans.py            # this user's cache
    OMP_NUM_THREADS=1 python benchmarks/calibration_plans.py '/tmp/torchalpa-test-cache-*'
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
from torchalpa.parallel.calibrate import Calibration

DIM, BATCH, WORLD = 32, 64, 4


class DropoutMLP(nn.Module):
    """A transformer MLP block with dropout after the activation and on the output."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


def matmul_layouts(cluster: torchalpa.Cluster) -> tuple[str, ...]:
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)
    plan = torchalpa.plan(DropoutMLP(), (x, y), F.mse_loss, cluster=cluster,
                          method=torchalpa.ShardParallel(logical_mesh_shape=(2, 2)))
    return tuple(f"{s.node} {s.outputs[0]}" for s in plan.strategies
                 if s.node.startswith("mm"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("roots", nargs="*", default=[os.path.expanduser("~/.cache/torchalpa")],
                   help="cache roots (globs) holding calibration/*-w4-*.json")
    args = p.parse_args()
    paths = sorted({f for root in args.roots
                    for f in glob.glob(os.path.join(root, "calibration", f"*-w{WORLD}-*.json"))})
    if not paths:
        raise SystemExit(f"no calibration of {WORLD} ranks under {args.roots}: run a "
                         f"{WORLD}-rank gloo job (or the tests) first")
    plans: dict[tuple[str, ...], int] = {}
    for path in paths:
        cluster = Calibration(json.loads(open(path).read())).cluster()
        layouts = matmul_layouts(cluster)
        plans[layouts] = plans.get(layouts, 0) + 1
    print(f"{len(paths)} calibrations, {len(plans)} distinct plans")
    for layouts, count in sorted(plans.items(), key=lambda kv: -kv[1]):
        print(f"{count:>4}  " + "; ".join(layouts))


if __name__ == "__main__":
    main()
