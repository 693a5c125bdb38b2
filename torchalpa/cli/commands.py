"""torchalpa's command line.

    torchalpa plan mypkg.train:workload --cluster h100:2x8 --out plan.json --html plan.html
    torchalpa plan gpt --method zero3 --cluster h100:1x8 --out plan.json
    torchalpa show plan.json [--module 'layers.0.*'] [--detail full]
    torchalpa explain plan.json layers.0.mlp.up_proj.weight
    torchalpa estimate llama --cluster h100:1x8      # fits, or how many devices it needs
    torchalpa cache ls | clear
    torchalpa bench mypkg.train:workload --nproc 4 --steps 3   # vs DDP and FSDP2, torchrun
    torchalpa coverage [--model llama --model mypkg.train:workload]
    torchalpa coverage --hf                     # the suite of models torchalpa was not written for
    torchalpa calibrate                         # time this GPU; planning here then uses it
    torchalpa --version

A model is a zoo family name (its tiny config, from ``torchalpa.models``) or
``module:callable``, where the callable returns a ``torchalpa.models.Workload`` or a tuple
``(model, example_inputs, loss_fn)``; it is called under ``torch.device("meta")``, so no
weights are allocated. A cluster is ``h100:NODESxDEVICES``, ``a100:NODESxDEVICES`` or
``cpu:N``.

``coverage`` captures each model's training step and prints which of its ATen ops have a
sharding rule and which do not (those run replicated on every device), with how many
nodes of the graph run each op; its exit status is 1 if an op has no rule or a model
fails to capture.

Each subcommand is one ``_add_<name>(commands)`` function that declares its arguments and
one ``_<name>(args)`` that runs it; torch is imported only inside the latter, so
``--help`` and ``--version`` stay fast.
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Callable
from pathlib import Path

from torchalpa.cli.workloads import (
    MODEL_HELP,
    load_workload,
    parse_cluster,
    parse_shape,
    zoo_module,
)

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, every subcommand included (imports no torch)."""
    examples = (__doc__ or "").split("\n\n")[1]
    parser = argparse.ArgumentParser(
        prog="torchalpa", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Plan how to parallelize a PyTorch training step over many devices "
                    "(Alpa's intra- and inter-operator parallelism), and inspect plans.",
        epilog="examples:\n" + examples)
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print torchalpa's version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"torchalpa {args.command}: {e}", file=sys.stderr)
        return 2


class _Version(argparse.Action):
    """``--version``, looked up only when asked (package metadata is slow to scan)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"torchalpa {_version()}")
        parser.exit()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("torchalpa")
    except PackageNotFoundError:
        return "unknown (not installed)"


# -- subcommands: one _add_<name> to declare, one _<name> to run ------------------------

def _add_plan(commands) -> None:
    p = commands.add_parser("plan", help="plan a model's training step for a cluster",
                            description="Capture MODEL's training step on the meta device and "
                                        "plan it for CLUSTER; write the plan as JSON.")
    p.add_argument("model", metavar="MODEL", nargs="?", help=MODEL_HELP)
    _workload_arguments(p)
    _cluster_argument(p)
    p.add_argument("--mixed-precision", choices=("bf16", "fp16"), metavar="DTYPE",
                   help="price bf16 or fp16 compute and activations with float32 master "
                        "states, as auto_parallel(mixed_precision=...) runs them")
    p.add_argument("--method", choices=METHODS, default="auto",
                   help="how to parallelize: auto (search every way, the default), shard "
                        "(intra-op ILP), data (DDP), zero1, zero2, zero3 (FSDP), pipeshard "
                        "(stages and intra-op)")
    p.add_argument("--mesh", metavar="AxB", help="a fixed logical mesh shape (default: try each; "
                   "with --method auto, an intra-op plan on that mesh)")
    p.add_argument("--out", metavar="PLAN.json", help="where to write the plan")
    p.add_argument("--detail", choices=("short", "full"), default="short",
                   help="full: every parameter, collective and candidate AutoParallel tried")
    from torchalpa.cli.stablehlo_commands import add_plan_options
    add_plan_options(p)
    p.add_argument("--html", metavar="PLAN.html", help="also write a picture of the plan")
    p.add_argument("--trace", metavar="TRACE.json",
                   help="also write the estimated timeline (Chrome trace / Perfetto)")
    p.add_argument("--verbose", action="store_true", help="stream the ILP solver's log")
    p.set_defaults(run=_plan)


def _plan(args) -> int:
    if args.stablehlo:
        from torchalpa.cli.stablehlo_commands import plan_stablehlo
        return plan_stablehlo(args)
    if not args.model or not args.out:
        raise ValueError("plan needs MODEL and --out PLAN.json (or --stablehlo FILE)")
    check_output_folders(args, ("out", "html", "trace"))
    import torch

    import torchalpa
    with torch.device("meta"):
        model, example_inputs, loss_fn = load_workload(args.model, batch=args.batch,
                                                       seq=args.seq)()
    method = method_of(args.method, parse_shape(args.mesh) if args.mesh else None)
    precision = None
    if args.mixed_precision:
        dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float16
        precision = torchalpa.MixedPrecision(param_dtype=dtype)
    from torchalpa.core.input_errors import BatchSplitError
    try:
        plan = torchalpa.plan(model, example_inputs, loss_fn, method=method,
                              cluster=_cluster_of(args), verbose=args.verbose,
                              mixed_precision=precision)
    except BatchSplitError as e:        # its remedy in this command line's flags
        raise ValueError(e.describe(f"use a --batch that {e.num_devices} divides, or "
                                    "--method shard")) from e
    plan.save(args.out)
    print(plan.summary(detail=args.detail))
    print(f"\nwrote {args.out}")
    _pictures(plan, args)
    return 0


METHODS = ("auto", "shard", "data", "zero1", "zero2", "zero3", "pipeshard")


def check_output_folders(args, options: tuple[str, ...]) -> None:
    """A ValueError naming the first file option whose folder does not exist: said before
    planning (minutes on a large model), not after it when the file is written."""
    for option in options:
        path = getattr(args, option, None)
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"--{option} {path}: the folder {Path(path).parent} does not "
                             "exist; create it or write elsewhere (checked before planning)")


def method_of(name: str, mesh: tuple[int, ...] | None):
    """The method ``--method NAME`` (and ``--mesh``) names."""
    import torchalpa
    if name == "pipeshard":
        if mesh is not None:
            raise ValueError("--mesh fixes one mesh for the whole step; --method pipeshard "
                             "cuts the cluster into submeshes: drop one of the two")
        return torchalpa.PipeshardParallel()
    if name == "auto":
        return None if mesh is None else torchalpa.ShardParallel(logical_mesh_shape=mesh)
    preset = {"shard": torchalpa.ShardParallel, "data": torchalpa.DataParallel,
              "zero1": torchalpa.Zero1Parallel, "zero2": torchalpa.Zero2Parallel,
              "zero3": torchalpa.Zero3Parallel}[name]
    return preset(logical_mesh_shape=mesh) if mesh is not None else preset()


def _pictures(plan, args) -> None:
    if getattr(args, "html", None):
        plan.to_html(args.html)
        print(f"wrote {args.html}")
    if getattr(args, "trace", None):
        plan.to_chrome_trace(args.trace)
        print(f"wrote {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")


def _add_show(commands) -> None:
    p = commands.add_parser("show", help="print a saved plan",
                            description="Print a plan saved by `torchalpa plan` or Plan.save.")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--module", metavar="GLOB", help="only parameters and collectives of "
                                                    "matching modules, e.g. 'layers.0.*'")
    p.add_argument("--detail", choices=("short", "full"), default="short",
                   help="short: repeated layers folded (default); full: every row")
    p.add_argument("--html", metavar="PLAN.html", help="also write a picture of the plan")
    p.add_argument("--trace", metavar="TRACE.json", help="also write the estimated timeline")
    p.set_defaults(run=_show)


def _show(args) -> int:
    plan = _load(args.plan)
    print(plan.summary(detail=args.detail, filter=args.module))
    _pictures(plan, args)
    return 0


def _add_explain(commands) -> None:
    p = commands.add_parser("explain", help="where a parameter lives and what moves it",
                            description="Explain one parameter, input or op of a saved plan.")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("name", metavar="NAME", help="e.g. layers.0.mlp.up_proj.weight")
    p.set_defaults(run=_explain)


def _explain(args) -> int:
    print(_load(args.plan).explain(args.name))
    return 0


def _add_estimate(commands) -> None:
    p = commands.add_parser(
        "estimate", help="does the model fit the cluster? (seconds, no solver)",
        description="Capture MODEL's training step and compare its model states (parameters, "
                    "gradients, Adam's two moments) with the cluster's memory: whether they fit "
                    "sharded over every device, or how many devices they need. Activations are "
                    "not counted: `torchalpa plan` gives the full estimate.")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    _workload_arguments(p)
    _cluster_argument(p)
    p.set_defaults(run=_estimate)


def _estimate(args) -> int:
    import math

    import torch

    from torchalpa.core.units import format_bytes
    with torch.device("meta"):
        model, _, _ = load_workload(args.model, batch=args.batch, seq=args.seq)()
    cluster = _cluster_of(args)
    params = [p for p in model.parameters()]
    num = sum(p.numel() for p in params)
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    # parameters + gradients in their dtype, Adam's exp_avg and exp_avg_sq in float32
    states = sum(p.numel() * p.element_size() for p in params) + trainable + \
        sum(2 * 4 * p.numel() for p in params if p.requires_grad)
    per_device = states / cluster.num_devices
    budget = cluster.memory_per_device
    print(f"{args.model}: {num / 1e6:,.1f} M parameters; model states with Adam "
          f"{format_bytes(states)}")
    needed = math.ceil(states / budget)
    if per_device <= budget:
        print(f"fits: {format_bytes(per_device)} per device when sharded over all "
              f"{cluster.num_devices} devices (of {format_bytes(budget)}); the states alone need "
              f"at least {needed} device(s); activations come on top")
        return 0
    print(f"does not fit: {format_bytes(per_device)} per device over {cluster.num_devices} "
          f"devices, more than {format_bytes(budget)}; needs at least {needed} devices of this "
          "kind (before activations)")
    return 1


def _add_cache(commands) -> None:
    p = commands.add_parser("cache", help="list or clear the plan cache",
                            description="Plans are cached on disk ($TORCHALPA_CACHE_DIR, else "
                                        "~/.cache/torchalpa), at most $TORCHALPA_CACHE_MAX_MB "
                                        "(default 1024) megabytes, oldest removed first.")
    p.add_argument("action", choices=("ls", "clear"))
    p.set_defaults(run=_cache)


def _cache(args) -> int:
    import time

    from torchalpa.core.units import format_bytes
    from torchalpa.parallel import cache
    root = cache.cache_dir()
    if root is None:
        print("the plan cache is off (TORCHALPA_CACHE=0)")
        return 0
    if args.action == "clear":
        files, size = cache.clear()
        print(f"removed {files} cached plan(s), {format_bytes(size)}, from {root}")
        return 0
    found = cache.entries()
    total = sum(e.bytes for e in found)
    print(f"{root}: {len(found)} plan(s), {format_bytes(total)} of "
          f"{format_bytes(cache.max_bytes())}")
    for e in found:
        age = time.time() - e.mtime
        when = f"{age / 3600:.1f} h" if age >= 3600 else f"{age / 60:.0f} min"
        print(f"  {e.key}  {format_bytes(e.bytes):>10}  {when:>8} ago  {e.description}")
    return 0


def _add_bench(commands) -> None:
    p = commands.add_parser(
        "bench", help="the automatic plan vs DDP vs FSDP2, under torchrun",
        description="Train MODEL with Adam on NPROC local ranks under torchrun (NCCL on GPUs, "
                    "gloo on CPUs) with torchalpa's automatic plan, DDP and FSDP2, one after "
                    "the other, and print one table: step time, ratio to the faster baseline, "
                    "bytes sent per step where measurable, peak memory (torchalpa/cli/bench.py).")
    p.add_argument("model", metavar="MODEL", help="a zoo family or module:callable")
    p.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--steps", type=int, default=3,
                   help="steps per method, the first untimed (default 3)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the methods this many times, alternating their order, and average")
    p.add_argument("--json", metavar="RESULT.json", help="also write the raw result")
    p.set_defaults(run=_bench)


def _bench(args) -> int:
    import json

    from rich.console import Console

    from torchalpa.cli.bench import format_table, run_bench
    load_workload(args.model)        # a bad name fails here, before torchrun starts
    try:
        result = run_bench(args.model, nproc=args.nproc, steps=args.steps, rounds=args.rounds)
    except RuntimeError as e:
        print(f"torchalpa bench: {e}", file=sys.stderr)
        return 1
    Console(width=120).print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _add_coverage(commands) -> None:
    coverage = commands.add_parser(
        "coverage", help="which ops of each model's training step have sharding rules",
        description="Capture each model's training step on the meta device and list its ops, "
                    "with or without a sharding rule. A model is a zoo family (its tiny "
                    "config) or module:callable returning a Workload or "
                    "(model, example_inputs, loss_fn).")
    coverage.add_argument("--model", action="append", metavar="NAME",
                          help="a zoo family or module:callable (repeatable; default: the zoo)")
    coverage.add_argument("--hf", action="store_true",
                          help="the suite of transformers architectures and PyTorch idioms "
                               "(torchalpa.suite.cases), with a summary table")
    coverage.set_defaults(run=_coverage)


# -- shared helpers -----------------------------------------------------------------------

def _workload_arguments(p) -> None:
    p.add_argument("--batch", type=int, metavar="N",
                   help="global batch size (zoo and hf: models; default: the model's)")
    p.add_argument("--seq", type=int, metavar="T",
                   help="sequence length (zoo and hf: models; default: the model's)")


def _cluster_argument(p) -> None:
    p.add_argument("--cluster", default="h100:1x8", metavar="KIND:NxD",
                   help="a GPU or machine preset with NODESxDEVICES (h100:2x8, h200:4x8, "
                        "a100-80:1x8, b200, mi300x, l4, v100-32, dgx-a100, p3.16xlarge, ...) "
                        "or cpu:N (default h100:1x8)")
    p.add_argument("--inter-node-bandwidth", type=float, metavar="GB/s",
                   help="bandwidth per device between nodes (default: the preset's network)")
    p.add_argument("--memory", type=float, metavar="GiB",
                   help="memory per device (default: the preset's usable memory)")


def _cluster_of(args):
    return parse_cluster(args.cluster, inter_node_gbps=args.inter_node_bandwidth,
                         memory_gib=args.memory)






def _load(path: str):
    from torchalpa.core.plan import load_plan
    return load_plan(path)








def _coverage(args) -> int:

    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.rules import rule_for

    names = list(args.model or ())
    if args.hf:
        from torchalpa.suite.cases import SUITE
        names += [f"suite:{name}" for name in SUITE]
    names = names or sorted(zoo_module().FAMILIES)
    failed = False
    without: dict[str, list[str]] = collections.defaultdict(list)
    table: list[tuple[str, str, str]] = []
    for name in names:
        try:
            model, example_inputs, loss_fn = _build_for_coverage(load_workload(name))
            graph = capture(model, example_inputs, loss_fn).graph
        except Exception as e:  # report every model, then fail
            print(f"\n{name}: could not capture: {type(e).__name__}: {e}")
            table.append((name, "FAILS", f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"))
            failed = True
            continue
        nodes = collections.Counter(n.op for n in graph.ops())
        missing = sorted({n.op for n in graph.ops() if rule_for(n, graph) is None})
        print(f"\n{name}: {len(nodes)} ops in {sum(nodes.values())} nodes, "
              f"{len(nodes) - len(missing)} with a sharding rule, {len(missing)} without")
        for op in sorted(nodes):
            print(f"  {'----' if op in missing else 'rule'}  {op:64s} x{nodes[op]}")
        for op in missing:
            without[op].append(name)
        table.append((name, "captures", f"{sum(nodes.values())} nodes" + (
            f", replicated: {', '.join(missing)}" if missing else "")))
    if any(name.startswith("suite:") for name in names):
        _print_suite_table([row for row in table if row[0].startswith("suite:")])
    print(f"\nops without a sharding rule (run replicated): {len(without) or 'none'}")
    for op in sorted(without):
        print(f"  {op}: {', '.join(without[op])}")
    return 1 if failed or without else 0


def _build_for_coverage(make):
    """``make()`` on the meta device (no memory, any size); a constructor that reads tensor
    values (torchvision's RegNet computes its widths with tensors and ``.tolist()``) cannot
    run there, so such a model is built on the CPU instead."""
    import torch
    try:
        with torch.device("meta"):
            return make()
    except (NotImplementedError, RuntimeError) as e:
        if "meta tensor" not in str(e):
            raise
        return make()


def _print_suite_table(rows: list[tuple[str, str, str]]) -> None:
    from torchalpa.suite.cases import SUITE
    print("\nmodel                  family           capture   notes")
    for name, status, notes in rows:
        case = SUITE.get(name.partition(":")[2])
        family = case.family if case else "-"
        known = f" (known: {case.known_failure[:60]}...)" if case and case.known_failure \
            and status == "FAILS" else ""
        print(f"{name.partition(':')[2] or name:22s} {family:16s} {status:9s} {notes}{known}")
    print(f"{sum(s == 'captures' for _, s, _ in rows)} of {len(rows)} capture")


def _add_export(commands) -> None:
    from torchalpa.cli.stablehlo_commands import add_export
    add_export(commands)


def _add_calibrate(commands) -> None:
    p = commands.add_parser(
        "calibrate", help="time this machine's GPU for the planner (CUDA)",
        description="Time this machine's GPU -- matmul flop/s per dtype and shape class, "
                    "memory bandwidth, the host's cost per op, fused attention -- and store "
                    "the profile where planning on this device (auto_parallel, torchalpa.plan "
                    "without a cluster) reads it instead of the datasheet figures. "
                    "About a minute.")
    p.add_argument("--no-save", action="store_true", help="print the figures, store nothing")
    p.set_defaults(run=_calibrate)


def _calibrate(args) -> int:
    from torchalpa.core.cluster import Cluster
    from torchalpa.parallel.calibrate_cuda import measure_device
    from torchalpa.parallel.device_profile import save_profile
    profile = measure_device()
    assumed = Cluster.detect(1, 1)
    print(f"{profile.device_name}, PyTorch {profile.torch_version}; measured (and what the "
          f"planner assumed without it, {assumed.name}):")
    peaks = dict(assumed.peak_flops_by_dtype)
    for dtype, rates in profile.matmul.items():
        cells = "  ".join(f"{cls} {rate / 1e12:.1f}" for cls, rate in rates.items())
        guess = peaks.get("float32" if dtype == "tf32" else dtype)
        print(f"  matmul {dtype:<9} TFLOP/s: {cells}"
              + (f"  (assumed {guess / 1e12:.1f})" if guess else ""))
    print(f"  memory bandwidth {profile.memory_bandwidth / 1e9:.0f} GB/s (assumed "
          f"{assumed.memory_bandwidth / 1e9:.0f}); host time per op "
          f"{profile.op_s * 1e6:.1f} us (assumed {assumed.kernel_launch_s * 1e6:.1f})")
    for dtype, rate in profile.attention.items():
        print(f"  attention {dtype} {rate / 1e12:.1f} TFLOP/s as priced")
    if not args.no_save:
        path = save_profile(profile)
        print(f"stored as {path}" if path else "not stored: no usable cache directory "
              "(TORCHALPA_CACHE_DIR)")
    return 0


SUBCOMMANDS: list[Callable] = [_add_plan, _add_show, _add_explain, _add_estimate, _add_cache,
                               _add_bench, _add_coverage, _add_export, _add_calibrate]


if __name__ == "__main__":
    raise SystemExit(main())
