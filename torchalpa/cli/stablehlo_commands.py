"""The StableHLO commands of torchalpa's command line.

    torchalpa plan --stablehlo step.mlir --mesh 2x4 [--preset h100] [--num-params N]
    torchalpa export --model gpt --out step.mlir [--plan plan.json]

``plan`` reads a training step in StableHLO (``@main``: parameters first, returning the
loss and one gradient per parameter: what ``jax.value_and_grad`` lowers to, or what
``torchalpa export`` writes) and prints its plan for a logical mesh (``--mesh 2x4``; by
default every 1D and 2D view of the devices is tried). ``export`` writes a model's
training step (a zoo family or ``module:callable``, as for ``coverage``) as StableHLO via
torch-mlir; ``--plan`` annotates its arguments with the plan's shardings.
``add_plan_options`` adds the StableHLO options to ``plan``; ``add_export`` registers
``export``.
"""

from __future__ import annotations

import argparse

__all__ = ["add_plan_options", "add_export", "plan_stablehlo"]

_PRESETS = ("local_cpu", "h100", "a100")


def add_plan_options(plan) -> None:
    """The StableHLO options of ``torchalpa plan`` (``--stablehlo FILE`` instead of MODEL)."""
    plan.add_argument("--stablehlo", default=None, metavar="FILE",
                      help="plan a StableHLO training step (.mlir) instead of a MODEL")
    plan.add_argument("--devices", type=int, default=None,
                      help="with --stablehlo: number of devices (default: the mesh's size)")
    plan.add_argument("--preset", choices=_PRESETS, default="h100",
                      help="with --stablehlo: hardware the devices are (default: h100, 8 per node)")
    plan.add_argument("--num-params", type=int, default=None,
                      help="with --stablehlo: how many leading arguments are parameters (needed "
                           "when the text does not mark them with torchalpa.kind)")
    plan.add_argument("--json", default=None, metavar="FILE",
                      help="with --stablehlo: also write the plan JSON")


def add_export(commands) -> None:
    """Register ``export`` on an argparse subparsers object."""
    export = commands.add_parser(
        "export", help="write a model's training step as StableHLO (torch-mlir)",
        description="Export a model's training step (forward, loss, backward) as StableHLO.")
    export.add_argument("--model", required=True, metavar="NAME",
                        help="a zoo family or module:callable returning (model, inputs, loss_fn)")
    export.add_argument("--out", required=True, metavar="FILE", help="where to write the .mlir")
    export.add_argument("--plan", default=None, metavar="FILE",
                        help="a plan JSON whose shardings annotate the arguments")
    export.add_argument("--sharding", choices=["mhlo", "sdy"], default="mhlo",
                        help="annotation dialect: GSPMD's mhlo.sharding or Shardy's sdy.sharding")
    export.set_defaults(run=_export)


def _mesh_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape) or len(shape) > 2:
        raise SystemExit(f"torchalpa plan: --mesh must look like 8 or 2x4, got {text!r}")
    return shape


def _cluster(preset: str, num_devices: int):
    from torchalpa.core.cluster import Cluster
    if preset == "local_cpu":
        return Cluster.local_cpu(num_devices)
    per_node = min(8, num_devices)
    if num_devices % per_node:
        raise SystemExit(f"torchalpa plan: {num_devices} devices do not fill nodes of "
                         f"{per_node}; pass a multiple of 8")
    make = Cluster.h100 if preset == "h100" else Cluster.a100
    return make(num_nodes=num_devices // per_node, devices_per_node=per_node)


def plan_stablehlo(args: argparse.Namespace) -> int:
    import math

    import torchalpa
    shape = _mesh_shape(args.mesh)
    num_devices = args.devices or (math.prod(shape) if shape else 8)
    if shape and math.prod(shape) != num_devices:
        raise SystemExit(f"torchalpa plan: --mesh {args.mesh} has {math.prod(shape)} devices, "
                         f"--devices says {num_devices}")
    cluster = _cluster(args.preset, num_devices)
    target = cluster.logical_mesh(shape) if shape else cluster
    plan = torchalpa.plan(args.stablehlo, (), cluster=target, num_params=args.num_params)
    print(plan.summary())
    if args.json:
        plan.save(args.json)
    return 0


def _export(args: argparse.Namespace) -> int:
    import torchalpa
    from torchalpa.cli.workloads import load_workload as _loader
    model, example_inputs, loss_fn = _loader(args.model)()
    plan = torchalpa.load_plan(args.plan) if args.plan else None
    if plan is not None and not isinstance(plan, torchalpa.Plan):
        raise ValueError(f"{args.plan}: export_stablehlo takes an intra-op plan, not a pipeline plan")
    text = torchalpa.export_stablehlo(model, example_inputs, loss_fn, plan=plan,
                                      sharding=args.sharding)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}: {len(text.splitlines())} lines of StableHLO")
    return 0
