"""Run a torchalpa plan with XLA: shardings for ``jax.jit`` and the collectives XLA chose.

A plan made from a JAX step (``torchalpa.plan(loss_fn, (params, x, y), ...)``) names its
parameters and inputs by pytree path (``params.layers.0.w``). ``shardings(plan, mesh,
example_args)`` turns their placements into ``NamedSharding``s shaped like the arguments,
for ``jax.jit(in_shardings=..., out_shardings=...)`` and ``with_sharding_constraint``.
``hlo_collectives(compiled.as_text())`` lists the collectives in XLA's compiled program,
and ``compare_collectives`` sets them beside the plan's: XLA merges collectives
(all-reduce combining, tuples) and may pick others, so the comparison reports per kind
the plan's count and bytes, XLA's ops, the tensors they carry and their bytes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torchalpa.core.placement import Partial, Shard, split_factor_of
from torchalpa.core.plan import Plan

__all__ = ["partition_spec", "shardings", "hlo_collectives", "compare_collectives",
           "compile_annotated", "HLO_KINDS"]

HLO_KINDS = {"all-reduce": "all_reduce", "all-gather": "all_gather",
             "reduce-scatter": "reduce_scatter", "all-to-all": "all_to_all",
             "collective-permute": "send_recv"}
_HLO_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s8": 1,
              "u8": 1, "pred": 1, "s16": 2, "u64": 8}


def partition_spec(placements, rank: int, axis_names: Sequence[str]):
    """DTensor placements (one per mesh axis) -> a ``PartitionSpec`` of ``rank`` dims."""
    from jax.sharding import PartitionSpec
    per_dim: list[list[str]] = [[] for _ in range(rank)]
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(f"a Partial placement ({p!r} on mesh axis {axis}) has no "
                             "NamedSharding; only parameters and inputs are placed with XLA")
        if split_factor_of(p) > 1:
            raise ValueError(f"a strided shard ({p!r} on mesh axis {axis}: a block of each of "
                             "its dim's pieces, as a fused q/k/v split by heads) has no "
                             "NamedSharding; pin that parameter to Shard or Replicate "
                             "(AutoShardingOption(pin=...)) to run this plan with XLA")
        if isinstance(p, Shard):
            per_dim[p.dim].append(axis_names[axis])      # mesh axes major first, as DTensor
    return PartitionSpec(*[None if not a else a[0] if len(a) == 1 else tuple(a)
                           for a in per_dim])


def shardings(plan: Plan, mesh, fn, example_args: Sequence):
    """``NamedSharding``s shaped like ``example_args`` from the plan's parameter and input
    placements. ``fn`` is the function the plan was made from (its argument names prefix
    the names of the leaves); ``mesh`` a ``jax.sharding.Mesh`` of the plan's shape and axes."""
    import jax
    from jax.sharding import NamedSharding

    from torchalpa.frontends.jax_lower import argument_names, leaf_names
    if tuple(mesh.axis_names) != tuple(plan.axis_names) or \
            tuple(mesh.devices.shape) != tuple(plan.mesh_shape):
        raise ValueError(f"the jax Mesh has axes {dict(mesh.shape)}, the plan "
                         f"{dict(zip(plan.axis_names, plan.mesh_shape))}; build "
                         "Mesh(devices.reshape(plan.mesh_shape), plan.axis_names)")
    placed = {p.name: p for p in plan.parameters + plan.inputs}
    names = argument_names(fn, len(example_args))
    out = []
    for arg, name in zip(example_args, names):
        leaves, tree = jax.tree_util.tree_flatten(arg)
        specs = []
        for leaf_name, _leaf in zip(leaf_names(arg, name), leaves):
            if leaf_name not in placed:
                raise KeyError(f"the plan has no placement for {leaf_name!r} (it places "
                               f"{', '.join(sorted(placed)[:8])}...): plan and run the same "
                               "step with the same argument names")
            spec = partition_spec(placed[leaf_name].placements, len(placed[leaf_name].shape),
                                  plan.axis_names)
            specs.append(NamedSharding(mesh, spec))
        out.append(jax.tree_util.tree_unflatten(tree, specs))
    return tuple(out)


def _shape_bytes(text: str) -> int:
    """Bytes of every array shape in an HLO type, e.g. ``(f32[4,8]{1,0}, f32[8]{0})``."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _HLO_BYTES.get(dtype, 4)
    return total


def _group_size(line: str) -> int:
    """Devices in each replica group of an HLO collective (its three spellings)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        n = 1
        for axis in re.findall(r"'([^']+)'", m.group(2)):
            n *= int(sizes.get(axis, 1))
        return n
    m = re.search(r"replica_groups=\[[\d,]*?(\d+)\]<=", line)    # iota: [groups,size]<=[n]
    if m:
        return int(m.group(1))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"source_target_pairs=", line)
    return 2 if m else 1


def hlo_collectives(hlo_text: str) -> list[dict]:
    """The collectives of a compiled HLO module: kind, tensors carried, bytes per rank.

    ``bytes`` is what each rank contributes, as in the plan: read from the op's result
    type (all-gather's result is ``group`` times that, reduce-scatter's ``1/group``). An
    op that carries several tensors (XLA's combiner merged them) counts them in
    ``tensors``.
    """
    found = []
    pattern = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|"
                         r"all-to-all|collective-permute)(-start)?\(")
    for line in hlo_text.splitlines():
        m = pattern.search(line)
        if not m:
            continue
        kind = HLO_KINDS[m.group(2)]
        result = m.group(1)
        if m.group(3):       # an async start returns (operands, results): keep the results
            shapes = re.findall(r"\b[a-z]+\d*\[[\d,]*\]", result)
            result = " ".join(shapes[len(shapes) // 2:])
        group = _group_size(line)
        nbytes = _shape_bytes(result)
        nbytes = nbytes // group if kind == "all_gather" else \
            nbytes * group if kind == "reduce_scatter" else nbytes
        found.append({"kind": kind, "group": group, "bytes": nbytes, "hlo": line.strip()[:160],
                      "tensors": max(1, len(re.findall(r"\b[a-z]+\d*\[[\d,]*\]", result)))})
    return found


def compare_collectives(plan: Plan, hlo_text: str) -> dict:
    """Per collective kind: the plan's count and bytes next to XLA's ops, tensors, bytes."""
    table: dict[str, dict] = {}
    for c in plan.collectives:
        row = table.setdefault(c.kind, dict(plan_count=0, plan_bytes=0, xla_ops=0,
                                            xla_tensors=0, xla_bytes=0))
        row["plan_count"] += 1
        row["plan_bytes"] += c.bytes
    for c in hlo_collectives(hlo_text):
        row = table.setdefault(c["kind"], dict(plan_count=0, plan_bytes=0, xla_ops=0,
                                               xla_tensors=0, xla_bytes=0))
        row["xla_ops"] += 1
        row["xla_tensors"] += c["tensors"]
        row["xla_bytes"] += c["bytes"]
    return table


def compile_annotated(text: str, plan: Plan, *, dialect: str = "mhlo") -> str:
    """XLA's compiled HLO (text) of a StableHLO step annotated for ``plan``
    (``torchalpa.interop.hlo_annotate``), partitioned over the first devices of this process
    (``plan``'s device count; host CPUs need ``XLA_FLAGS=--xla_force_host_platform_device_count``
    set before jax is imported). ``dialect="sdy"`` compiles with the Shardy partitioner."""
    import math

    import jax
    import numpy as np
    from jax._src import compiler
    from jax._src.lib import xla_client

    num_devices = math.prod(plan.mesh_shape)
    devices = jax.devices()[:num_devices]
    if len(devices) < num_devices:
        raise ValueError(f"the plan needs {num_devices} devices, this process has "
                         f"{len(devices)}: on CPU set XLA_FLAGS=--xla_force_host_platform_"
                         f"device_count={num_devices} before importing jax")
    options = compiler.get_compile_options(
        num_replicas=1, num_partitions=num_devices,
        device_assignment=np.arange(num_devices).reshape(1, num_devices))
    options.executable_build_options.use_spmd_partitioning = True
    options.executable_build_options.use_shardy_partitioner = dialect == "sdy"
    client = devices[0].client
    executable = client.compile_and_load(text, xla_client.DeviceList(tuple(devices)),
                                         options)
    return executable.hlo_modules()[0].to_string()
