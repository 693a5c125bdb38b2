"""How long planning torchvision's CNNs takes with each ILP solver, and what it finds.

    python benchmarks/solve_cnn.py [--models resnet18 mobilenet_v3_small ...]
                                   [--solvers cbc highs] [--devices 4] [--image 64]
    python benchmarks/solve_cnn.py --bound [--models ...]

Each model (full size, torchvision's own builder, random weights, 10 classes, batch 4 of
``--image`` pixels) is captured once, then planned by ``torchalpa.plan`` for
``Cluster.local_cpu(devices)`` with each solver in turn, one after the other in this
process (no plan cache): every 1D and 2D view of the devices is solved, each simplified
and, below ``exact_below`` nodes, unsimplified too. Printed per model and solver: wall
seconds of the whole plan, the chosen view and its estimated step, and the objective on
the 2 x 2 view (where the two solvers differ most); the last column is the ratio of
seconds to the first solver's.

``--bound`` instead plans each model with HiGHS twice, without and then with skipping a
view whose step-time bound (the linear relaxation of its ILP) is above the fastest plan
found so far (``SearchSwitches.skip_by_bound``, ``torchalpa/core/switches.py``): seconds,
view and estimate of each, and the ratio of seconds. The skip must not change the view or the estimate. ``zoo:gpt``,
``zoo:llama``... name the zoo's transformers (256 wide, 4 layers, batch 8; e.g. with
``--devices 8``), whose views plan alike: there the bound costs time and skips nothing.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F

import torchalpa
from torchalpa.core.switches import SearchSwitches
from torchalpa.suite.cases import _torchvision

MODELS = ["resnet18", "mobilenet_v3_small", "mnasnet0_5", "googlenet"]


def plan_seconds(model, batch, solver: str, devices: int, shape=None, loss_fn=F.cross_entropy):
    option = torchalpa.AutoShardingOption(solver=solver)
    method = torchalpa.ShardParallel(auto_sharding_option=option, logical_mesh_shape=shape)
    start = time.perf_counter()
    plan = torchalpa.plan(model, batch, loss_fn, method=method,
                          cluster=torchalpa.Cluster.local_cpu(devices))
    return time.perf_counter() - start, plan


def _bound_run(name: str, image: int, devices: int, skip: bool) -> tuple[float, str, float]:
    """Plan one model in this (fresh) process, skipping views by their bound or not."""
    os.environ["TORCHALPA_CACHE"] = "0"
    os.environ.setdefault("TORCHALPA_LOG", "warning")
    if name.startswith("zoo:"):     # a transformer, where the views plan alike
        import torchalpa.models as zoo
        w = zoo.tiny(name[4:], batch_size=8, hidden=256, num_layers=4)
        with torch.device("meta"):
            model, batch = w.build(), w.example_inputs()
        loss_fn = w.loss_fn
    else:
        model, batch = _build(_torchvision(), name, image)
        loss_fn = F.cross_entropy
    with SearchSwitches.using(skip_by_bound=skip):
        seconds, plan = plan_seconds(model, batch, "highs", devices, loss_fn=loss_fn)
    return seconds, "x".join(map(str, plan.mesh_shape)), plan.estimates.step_time_s * 1e3


def bound_ab(name: str, image: int, devices: int) -> None:
    """One model planned without, then with, skipping views by their bound, each in a
    fresh process (a second plan in the same process would find warm caches)."""
    rows = []
    for skip in (False, True):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows.append(pool.submit(_bound_run, name, image, devices, skip).result())
    (s0, v0, e0), (s1, v1, e1) = rows
    print(f"{name:20s} {s0:9.1f} {v0:>5s} {e0:8.3f} {s1:9.1f} {v1:>5s} {e1:8.3f} "
          f"{s1 / s0:7.2f}", flush=True)


def _build(models, name: str, image: int):
    """torchvision's ``name`` with 10 classes and a batch of 4 ``image``-pixel images."""
    kwargs = {"aux_logits": False, "init_weights": False} if name == "googlenet" else {}
    torch.manual_seed(0)
    model = models.get_model(name, num_classes=10, **kwargs)
    return model, (torch.randn(4, 3, image, image), torch.randint(10, (4,)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--solvers", nargs="+", default=["cbc", "highs"])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--image", type=int, default=64)
    p.add_argument("--bound", action="store_true",
                   help="compare planning without and with skipping views by their bound")
    args = p.parse_args(argv)
    os.environ["TORCHALPA_CACHE"] = "0"
    os.environ.setdefault("TORCHALPA_LOG", "warning")
    models = _torchvision()
    if args.bound:
        print(f"{'model':20s} {'no skip s':>9s} {'view':>5s} {'est ms':>8s} "
              f"{'skip s':>9s} {'view':>5s} {'est ms':>8s} {'ratio':>7s}", flush=True)
        for name in args.models:
            bound_ab(name, args.image, args.devices)
        return
    print(f"{'model':20s} {'solver':6s} {'plan s':>7s} {'view':>7s} {'est ms':>8s} "
          f"{'2x2 objective':>14s} {'s / first':>9s}", flush=True)
    for name in args.models:
        model, batch = _build(models, name, args.image)
        first = None
        for solver in args.solvers:
            seconds, plan = plan_seconds(model, batch, solver, args.devices)
            _, square = plan_seconds(model, batch, solver, args.devices, (2, 2)) \
                if args.devices == 4 else (0.0, None)
            first = first or seconds
            view = "x".join(map(str, plan.mesh_shape))
            objective = f"{square.estimates.objective:.6g}" if square is not None else "-"
            print(f"{name:20s} {solver:6s} {seconds:7.1f} {view:>7s} "
                  f"{plan.estimates.step_time_s * 1e3:8.3f} {objective:>14s} "
                  f"{seconds / first:9.2f}", flush=True)


if __name__ == "__main__":
    main()
