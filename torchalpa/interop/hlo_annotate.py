"""A StableHLO step annotated with its plan, so XLA's partitioner runs the plan.

``annotate_stablehlo(text, plan)`` takes the step a plan was made from (the plan of
``torchalpa.plan(text, ...)`` or of a JAX function's lowering) and marks:

- every parameter and input argument with its placement, and every gradient result with
  its parameter's placement (the loss replicated);
- every resharding point of the plan: where an op reads a value in another layout than
  its producer wrote it (``plan.reshards`` with a collective), the operand goes through a
  sharding constraint with the layout the op reads. (A local slice of a whole value gets
  none: constraining those made XLA gather elsewhere; it may then compute such an op
  whole, e.g. a bias gradient summed over the whole batch where the plan sums its slice
  and all-reduces.) Without these XLA propagates the
  argument shardings by its own heuristics and may choose other collectives; with them
  its partitioner reproduces the plan's layouts between ops as well.

Two spellings (``dialect=``): ``"mhlo"`` (GSPMD: ``mhlo.sharding`` attributes and
``stablehlo.custom_call @Sharding`` constraints, HLO sharding strings from
``hlo_sharding``) and ``"sdy"`` (Shardy: a ``sdy.mesh`` named ``mesh``
with the plan's axes, ``sdy.sharding`` attributes, ``sdy.sharding_constraint`` ops).

Resharding points are named by graph nodes, so they are annotated only when the plan was
made from this very program (same graph fingerprint); a plan of another graph of the step
(the ATen plan of an exported torch model) places the arguments and results only.
A reshard is annotated when its value is an MLIR value of ``@main`` (not a view the
reader inserted) read by an op of ``@main``, and the layout read is not a Partial sum
(neither spelling can say "partial" at an op boundary; XLA places the reduction itself).
``AnnotatedProgram.skipped`` counts the reshards left to XLA, and says why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from torchalpa.core.opgraph import ValueRef
from torchalpa.core.placement import Partial, Shard, split_factor_of
from torchalpa.core.plan import Plan

__all__ = ["annotate_stablehlo", "AnnotatedProgram", "hlo_sharding", "sdy_sharding", "load_annotated", "DIALECTS"]

DIALECTS = ("mhlo", "sdy")


@dataclass
class AnnotatedProgram:
    """The annotated text, the constraints placed and the reshards left to XLA."""

    text: str
    constraints: list[str] = field(default_factory=list)    # "producer -> consumer: layout"
    skipped: dict[str, int] = field(default_factory=dict)   # why -> count


def hlo_sharding(placements, rank: int, mesh_shape: Sequence[int]) -> str:
    """An HLO sharding string (``{devices=[1,4]<=[4]}``) for DTensor placements."""
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"{placements}: a Partial value has no HLO sharding annotation")
    for axis, p in enumerate(placements):
        if split_factor_of(p) > 1:
            raise ValueError(f"{placements}: a strided shard on mesh axis {axis} (a block of "
                             "each of its dim's pieces, as a fused q/k/v split by heads) has "
                             "no HLO sharding annotation; pin that parameter to Shard or "
                             "Replicate (AutoShardingOption(pin=...)) to export this plan")
    tiles = [1] * rank
    order: list[int] = []                      # mesh axes in tile order
    for dim in range(rank):
        for axis, p in enumerate(placements):
            if isinstance(p, Shard) and p.dim == dim:
                tiles[dim] *= mesh_shape[axis]
                order.append(axis)
    replicated = [a for a in range(len(mesh_shape)) if a not in order]
    if not order:
        return "{replicated}"
    num_replicas = math.prod(mesh_shape[a] for a in replicated)
    dims = tiles + ([num_replicas] if num_replicas > 1 else [])
    perm = order + replicated
    if perm == sorted(perm):                   # devices in mesh order: XLA's short form
        iota = f"<=[{math.prod(mesh_shape)}]"
    else:
        iota = f"<=[{','.join(map(str, mesh_shape))}]T({','.join(map(str, perm))})"
    tail = " last_tile_dim_replicate" if num_replicas > 1 else ""
    return f"{{devices=[{','.join(map(str, dims))}]{iota}{tail}}}"


def sdy_sharding(placements, rank: int, axis_names: Sequence[str], mesh: str = "mesh") -> str:
    """A Shardy tensor sharding (``#sdy.sharding<@mesh, [{"a0"}, {}]>``) for placements;
    a dim sharded over several mesh axes lists them major first, as DTensor applies them."""
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"{placements}: a Partial value has no Shardy sharding")
    dims: list[list[str]] = [[] for _ in range(rank)]
    for axis, p in enumerate(placements):
        if split_factor_of(p) > 1:
            raise ValueError(f"{placements}: a strided shard on mesh axis {axis} (a block of "
                             "each of its dim's pieces, as a fused q/k/v split by heads) has "
                             "no Shardy sharding; pin that parameter to Shard or Replicate "
                             "(AutoShardingOption(pin=...)) to export this plan")
        if isinstance(p, Shard):
            dims[p.dim].append(f'"{axis_names[axis]}"')
    return f"#sdy.sharding<@{mesh}, [{', '.join('{' + ', '.join(d) + '}' for d in dims)}]>"


def annotate_stablehlo(text: str, plan: Plan, *, dialect: str = "mhlo",
                       num_params: int | None = None,
                       param_names: Sequence[str] | None = None,
                       input_names: Sequence[str] | None = None) -> AnnotatedProgram:
    """``text`` with the plan's argument, result and resharding-point shardings."""
    from torchalpa.frontends.stablehlo import read_program
    if dialect not in DIALECTS:
        raise ValueError(f"dialect={dialect!r}: choose one of {DIALECTS}")
    read = read_program(text, num_params=num_params, param_names=param_names,
                        input_names=input_names)
    missing = sorted(p.name for p in plan.parameters if p.name not in read.graph.params)
    if missing:
        raise ValueError(f"the plan places {missing[:4]}, which this program does not take: "
                         "plan the same StableHLO text, then annotate it")
    from jax._src.lib.mlir import ir
    out = AnnotatedProgram(text="")
    with read.context:   # pyright: ignore[reportGeneralTypeIssues]
        module = read.module
        main = next(op.operation for op in module.body.operations   # pyright: ignore
                    if op.operation.name == "func.func"
                    and str(op.operation.attributes["sym_name"]).strip('"') == "main")
        spell = _Speller(plan, dialect, ir)
        if dialect == "sdy":
            _add_sdy_mesh(module, plan, ir)
        _annotate_signature(main, read.graph, plan, spell, ir)
        in_main = {op.operation for op in main.regions[0].blocks[0].operations}
        if plan.graph_fingerprint == read.graph.fingerprint():
            for reshard in plan.reshards:
                _constrain(reshard, read, in_main, spell, ir, out)
        elif plan.reshards:           # e.g. the ATen plan of an exported torch step
            out.skipped["the plan was made from another graph of the step"] = \
                len(plan.reshards)
        out.text = module.operation.get_asm(  # pyright: ignore[reportAttributeAccessIssue]
            enable_debug_info=True)              # source locations kept
    return out


class _Speller:
    """Sharding attributes and constraint ops in the chosen dialect."""

    def __init__(self, plan: Plan, dialect: str, ir):
        self.plan, self.dialect, self.ir = plan, dialect, ir

    def attr_name(self) -> str:
        return "mhlo.sharding" if self.dialect == "mhlo" else "sdy.sharding"

    def attr(self, placements, rank: int):
        if self.dialect == "mhlo":
            return self.ir.StringAttr.get(hlo_sharding(placements, rank, self.plan.mesh_shape))
        return self.ir.Attribute.parse(sdy_sharding(placements, rank, self.plan.axis_names))

    def constraint(self, value, placements, rank: int):
        """An op that constrains ``value`` to ``placements`` (inserted at the insertion
        point); its result."""
        ir = self.ir
        if self.dialect == "mhlo":
            op = ir.Operation.create(
                "stablehlo.custom_call", results=[value.type], operands=[value],
                loc=ir.Location.unknown(),
                attributes={"call_target_name": ir.StringAttr.get("Sharding"),
                            "mhlo.sharding": self.attr(placements, rank)})
        else:
            op = ir.Operation.create(
                "sdy.sharding_constraint", results=[value.type], operands=[value],
                loc=ir.Location.unknown(),
                attributes={"sharding": self.attr(placements, rank)})
        return op.results[0]


def _add_sdy_mesh(module, plan: Plan, ir) -> None:
    axes = ", ".join(f'"{name}"={size}' for name, size in zip(plan.axis_names,
                                                                 plan.mesh_shape))
    mesh = ir.Operation.parse(f"sdy.mesh @mesh = <[{axes}]>")
    ir.InsertionPoint(module.body.operations[0]).insert(mesh)


def _annotate_signature(main, graph, plan: Plan, spell: _Speller, ir) -> None:
    """Arguments: their plan placement; results: loss replicated, gradients as their
    parameters."""
    placed = {p.name: p for p in plan.parameters + plan.inputs}
    leaves = [n for n in graph if n.is_leaf]
    old = main.attributes["arg_attrs"] if "arg_attrs" in main.attributes else None
    arg_dicts = []
    for i, node in enumerate(leaves):
        attrs = {} if old is None else {a.name: a.attr for a in ir.DictAttr(old[i])}
        p = placed.get(node.target or "")
        if p is not None:
            attrs[spell.attr_name()] = spell.attr(p.placements, len(p.shape))
        arg_dicts.append(ir.DictAttr.get(attrs))
    main.attributes["arg_attrs"] = ir.ArrayAttr.get(arg_dicts)
    results = [ir.DictAttr.get({spell.attr_name(): spell.attr((), 0)})]
    for name, _ in graph.outputs.grads:
        p = placed.get(name)
        results.append(ir.DictAttr.get({} if p is None else {
            spell.attr_name(): spell.attr(p.placements, len(p.shape))}))
    main.attributes["res_attrs"] = ir.ArrayAttr.get(results)


def _constrain(reshard, read, in_main, spell: _Speller, ir, out: AnnotatedProgram) -> None:
    """One sharding constraint on the operand a resharding point names, if it can be put."""
    steps = [s for s in reshard.steps if s.is_collective]
    if not steps or not isinstance(reshard.slot, int):
        return
    dst = reshard.steps[-1].dst
    value = read.values.get(ValueRef(reshard.producer, reshard.index))
    op = read.ops.get(reshard.consumer)
    if value is None:
        why = "value is a view the reader inserted"
    elif op is None or op not in in_main:
        why = "consumer is not an op of @main"
    elif any(isinstance(p, Partial) for p in dst):
        why = "read as a Partial sum"
    else:
        why = ""
    uses = [] if why or op is None else [i for i, v in enumerate(op.operands) if v == value]
    if not why and not uses:
        why = "consumer reads it through a view"
    if why or op is None:
        out.skipped[why] = out.skipped.get(why, 0) + 1
        return
    rank = len(read.graph.spec(ValueRef(reshard.producer, reshard.index)).shape)
    with ir.InsertionPoint(op):
        constrained = spell.constraint(value, dst, rank)
    for i in uses:
        op.operands[i] = constrained
    out.constraints.append(f"{reshard.producer} -> {reshard.consumer}: "
                           f"{', '.join(str(p) for p in dst)}")


def load_annotated(text: str, plan: Plan, mesh, arg_names: Sequence[str]):
    """The annotated step compiled by XLA's SPMD partitioner for ``mesh`` (a
    ``jax.sharding.Mesh`` of the plan's shape and axes), as a function of global
    ``jax.Array``s -> ``(loss, *grads)`` global arrays, and XLA's compiled HLO text.

    ``arg_names`` name ``@main``'s arguments as the plan does (parameters, then inputs):
    each argument is placed with its plan placement before the call, and each gradient
    is reassembled with its parameter's. Unlike ``jax.jit`` of the Python function, this
    runs the program with the plan's sharding constraints between ops as well."""
    import jax
    import numpy as np
    from jax._src import compiler
    from jax._src.lib import xla_client
    from jax.sharding import NamedSharding, PartitionSpec

    from torchalpa.interop.xla import partition_spec
    placed = {p.name: p for p in plan.parameters + plan.inputs}
    missing = [n for n in arg_names if n not in placed]
    if missing:
        raise ValueError(f"the plan places no {missing[:4]}: name the arguments as the plan "
                         "does (lower_jax's param_names + input_names)")
    devices = list(mesh.devices.flat)
    options = compiler.get_compile_options(
        num_replicas=1, num_partitions=len(devices),
        device_assignment=np.arange(len(devices)).reshape(1, len(devices)))
    options.executable_build_options.use_spmd_partitioning = True
    options.executable_build_options.use_shardy_partitioner = "sdy.mesh" in text
    executable = devices[0].client.compile_and_load(
        text, xla_client.DeviceList(tuple(devices)), options)

    def sharding(name: str):
        p = placed[name]
        return NamedSharding(mesh, partition_spec(p.placements, len(p.shape), plan.axis_names))
    in_shardings = [sharding(n) for n in arg_names]
    params = {p.name for p in plan.parameters}
    grad_names = [n for n in arg_names if n in params]     # @main's order: its results'
    out_shardings = [NamedSharding(mesh, PartitionSpec())] + [sharding(n) for n in grad_names]

    def run(*args):
        placed_args = [jax.device_put(a, s) for a, s in zip(args, in_shardings)]
        shards = executable.execute_sharded(placed_args).disassemble_into_single_device_arrays()
        shapes = [()] + [tuple(placed[n].shape) for n in grad_names]
        return tuple(jax.make_array_from_single_device_arrays(shape, s, list(pieces))
                     for shape, s, pieces in zip(shapes, out_shardings, shards))
    return run, executable.hlo_modules()[0].to_string()
