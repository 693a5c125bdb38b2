"""Every legal placement of each op on a logical mesh, derived from its factor rule.

For each mesh axis a strategy picks one factor to shard over it (a factor may take both
axes of a 2D mesh: Alpa's S01), or none (replicated work), or lets a Partial value flow
through one of the rule's linear operand groups. Placements of every operand and result
follow from the rule; assignments that split a factor unevenly, shard a blocked factor,
or shard a dim by a minor factor are illegal and dropped.

A rule's ``synced`` factor (a softmax over a split vocabulary) may be split although the
results depend on all of it: the strategy then lists the all-reduces of the op's per-row
statistics (``Strategy.syncs``), which ``sync_steps`` turns into priced plan steps. A
synced factor that indexes no result (the fused cross-entropy's vocabulary) leaves the
results whole (``Replicate``) on the axes that split it. A
rule's ``batch_synced`` factor (training batch norm's split batch) lists instead one sum
all-reduce of the op's statistics per axis that splits it (``Strategy.batch_syncs``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpNode, TensorSpec
from torchalpa.core.placement import (
    Partial,
    Placements,
    Replicate,
    Shard,
    is_shard,
    short,
    split_factor_of,
    strided,
)
from torchalpa.core.plan import ReshardStep
from torchalpa.passes.rules.registry import FactorNamer, FactorRule

__all__ = ["Strategy", "StrategySpace", "enumerate_strategies", "replicate_only",
           "leaf_strategies", "splits_over_both_axes", "sync_steps"]


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run an op: operand layouts it reads, result layouts it writes."""

    inputs: tuple[Placements | None, ...]   # None: the operand is read for its shape only
    outputs: tuple[Placements, ...]
    shards: int = 1                          # ways the op's work is divided
    syncs: tuple[tuple[str, int], ...] = ()  # (reduce op, mesh axis) of each statistic's
    sync_dim: int | None = None              # all-reduce, in order; the result dim they span
                                             # (None: no result has it)
    batch_syncs: tuple[tuple[int, int], ...] = ()  # (mesh axis, bytes): sum all-reduces of
                                                   # a batch-synced op's statistics

    @property
    def name(self) -> str:
        ins = ", ".join("*" if p is None else short(p) for p in self.inputs)
        dim = "" if self.sync_dim is None else f" dim {self.sync_dim}"
        synced = f" syncing{dim}" if self.syncs else ""
        return f"({ins}) -> {', '.join(short(p) for p in self.outputs)}{synced}"


@dataclass
class StrategySpace:
    """Every node's strategies for one graph on one mesh, with the ops that have no rule
    (planned replicated), notes for the plan, and the nodes whose rules say they are
    compute-bound (``heavy``) or draw random numbers (``random``)."""

    strategies: dict[str, list[Strategy]]
    unsupported: list[dict]
    notes: list[str]
    heavy: frozenset = frozenset()   # nodes whose rule says compute-bound
    random: frozenset = frozenset()  # nodes whose rule says they draw random numbers


def sync_steps(s: Strategy, result: TensorSpec, mesh_shape) -> tuple[ReshardStep, ...]:
    """The all-reduces of ``s``'s statistics (``()`` for most strategies): each statistic
    has the shape of the first result (``result``) with the synced dim reduced to 1 (the
    first result's own shape where the synced factor indexes no result: the fused
    cross-entropy's per-token statistics), laid out like it, and is a partial max or sum
    over the axes that split that dim."""
    if not s.syncs:
        return ()
    shape = list(result.shape)
    if s.sync_dim is not None:
        shape[s.sync_dim] = 1
    stat = TensorSpec(tuple(shape), result.dtype)
    layout = tuple(Replicate() if is_shard(p) and p.dim == s.sync_dim else p
                   for p in s.outputs[0])
    nbytes = stat.nbytes
    for axis, p in enumerate(layout):
        if is_shard(p):
            nbytes //= mesh_shape[axis]
    steps = []
    for op, axis in s.syncs:
        src = layout[:axis] + (Partial(op),) + layout[axis + 1:]
        steps.append(ReshardStep(kind="all_reduce", axis=axis, bytes=nbytes, src=src,
                                 dst=layout, reduce_op=op))
    return tuple(steps)


def _placement_for(dims, factor: str, size_of: dict[str, int], stride: int = 1,
                   minor_ok: frozenset = frozenset()):
    """Where sharding ``factor`` puts an operand or result with these ``dims``: Shard(dim)
    if it leads a dim; None if absent; False if illegal (a minor factor of a merged dim, or
    a factor indexing two dims). ``stride`` > 1 reads the factor's positions as ``stride``
    pieces (a strided shard, only of a dim the factor spans alone); a factor in
    ``minor_ok`` may be a minor factor of a merged dim (the factors before it read as
    pieces, those after it whole): a strided shard of it."""
    found = None
    for d, factors in enumerate(dims):
        if factor not in factors:
            continue
        if found is not None:
            return False   # the factor indexes two dims
        real = [f for f in factors if size_of[f] != 1]
        if real == [factor]:
            found = Shard(d) if stride == 1 else strided(d, stride)
        elif real[0] == factor and stride == 1:
            found = Shard(d)
        elif factor in minor_ok:   # pieces of the dim lead; the factors after it stay whole
            found = strided(d, stride * math.prod(size_of[f] for f in real[:real.index(factor)]))
        else:
            return False
    return found


def enumerate_strategies(rule: FactorRule, mesh: LogicalMesh,
                         recompute_heavy: bool = False,
                         strides: tuple[tuple[int, int], ...] = ()) -> list[Strategy]:
    """All legal strategies of an op with this rule on this mesh (deduplicated).
    ``recompute_heavy`` keeps the strategies that run a compute-bound op redundantly.
    ``strides``: (k, size) pairs: a factor of that size may also be split as k pieces (a
    strided shard), for an op that does not care which positions of it a device holds."""
    size_of = rule.size_of
    reduction_of = rule.reduction_of
    shardable = [f for f in rule.factors() if f not in rule.blocked and size_of[f] > 1]
    choices: list[tuple] = [(None,)] + [("factor", f, 1) for f in shardable] + \
        [("factor", f, k) for f in shardable for k, size in strides if size_of[f] == size] + \
        [("linear", g) for g in rule.linear]
    strategies: dict[tuple, Strategy] = {}
    for assignment in itertools.product(choices, repeat=mesh.ndim):
        s = _build(rule, mesh, assignment, size_of, reduction_of)
        if s is not None:
            strategies.setdefault((s.inputs, s.outputs, s.syncs, s.batch_syncs), s)
    result = list(strategies.values())
    if rule.heavy and mesh.num_devices > 1 and not recompute_heavy:
        # Alpa's policy: compute-bound ops are never run redundantly when a split exists.
        full = [s for s in result if s.shards == mesh.num_devices]
        if full:
            result = full
    return result


def _build(rule, mesh, assignment, size_of, reduction_of) -> Strategy | None:
    num_operands = len(rule.operands)
    inputs = [[None] * mesh.ndim for _ in range(num_operands)]
    outputs = [[None] * mesh.ndim for _ in rule.results]
    split = {}  # factor -> product of axis sizes it is sharded over
    shards = 1
    synced = dict(rule.synced)
    sync_axes: dict[str, list[int]] = {}   # synced factor -> the axes that split it
    batch_sync_axes: list[int] = []        # the axes that split a batch-synced factor
    for axis, choice in enumerate(assignment):
        n = mesh.shape[axis]
        if choice[0] is None or n == 1:
            for ps in inputs + outputs:
                ps[axis] = Replicate()
            continue
        if choice[0] == "linear":
            group = choice[1]
            for i in range(num_operands):
                inputs[i][axis] = Partial("sum") if i in group else Replicate()
            for ps in outputs:
                ps[axis] = Partial("sum")
            continue
        factor, stride = choice[1], choice[2]
        split[factor] = split.get(factor, 1) * n
        if size_of[factor] % (split[factor] * stride):
            return None
        shards *= n
        if factor in synced:
            sync_axes.setdefault(factor, []).append(axis)
        if factor in rule.batch_synced:
            batch_sync_axes.append(axis)
        for i, dims in enumerate(rule.operands):
            p = _placement_for(dims, factor, size_of, stride, rule.strided)
            if p is False:
                return None
            if p is None:  # an accumulator holds its share of a sum; others are whole
                accumulates = i in rule.accumulators and factor in reduction_of
                p = Partial(reduction_of[factor]) if accumulates else Replicate()
            inputs[i][axis] = p
        for j, dims in enumerate(rule.results):
            p = _placement_for(dims, factor, size_of, stride, rule.strided)
            if p is False:
                return None
            if p is None and factor in synced:
                if _indexes_a_result(rule, factor):
                    return None  # a synced factor leaves the results it indexes whole
                p = Replicate()  # made whole by the statistics' all-reduces
            if p is None:
                op = reduction_of.get(factor)
                if factor in rule.batch_synced:
                    p = Replicate()  # summed inside the op: whole on every device
                elif j < len(rule.independent) and factor in rule.independent[j]:
                    p = Replicate()  # the result does not depend on this factor
                elif op is None:
                    return None  # a factor that vanishes without being reduced
                else:
                    p = Partial(op)
            outputs[j][axis] = p
    if not _strided_alone(inputs + outputs, mesh):
        return None
    ins = tuple(None if i in rule.ignored else tuple(p) for i, p in enumerate(inputs))
    syncs, sync_dim = (), None
    if sync_axes:
        if len(sync_axes) > 1:
            return None  # one synced dim per op: its statistics are reduced in one pass
        (factor, axes), = sync_axes.items()
        sync_dim = next((d for d, fs in enumerate(rule.results[0]) if factor in fs), None)
        syncs = tuple((op, axis) for op in synced[factor] for axis in axes)
    return Strategy(inputs=ins, outputs=tuple(tuple(p) for p in outputs), shards=shards,
                    syncs=syncs, sync_dim=sync_dim,
                    batch_syncs=_batch_sync_all_reduces(rule, batch_sync_axes, split, size_of))


def _indexes_a_result(rule: FactorRule, factor: str) -> bool:
    """Whether ``factor`` indexes a dim of some result of ``rule``."""
    return any(factor in fs for dims in rule.results for fs in dims)


def _strided_alone(layouts, mesh: LogicalMesh) -> bool:
    """A strided shard is the only split of its dim (over one axis), or every split of
    its dim is a strided shard with the same ``split_factor`` (``placement.stacked_strided``:
    the pieces split by each axis in turn, as a fused q/k/v split by heads over two axes):
    pieces nested inside another axis's plain blocks are a layout the runtime does not lay
    out (the nested shard ``gradient_scatter`` stores is made after the ILP)."""
    for layout in layouts:
        dims = [(p.dim, split_factor_of(p)) for p, n in zip(layout, mesh.shape)
                if is_shard(p) and n > 1]
        for d, k in dims:
            if k > 1 and any(dd == d and kk != k for dd, kk in dims):
                return False
    return True


def _batch_sync_all_reduces(rule: FactorRule, axes: list[int], split: dict[str, int],
                            size_of: dict[str, int]) -> tuple[tuple[int, int], ...]:
    """(axis, bytes per device) of the all-reduce a batch-synced op runs on each axis that
    splits one of its batch-synced factors: the statistics as this device holds them."""
    if not axes:
        return ()
    per_entry, factors = rule.batch_sync_stats
    entries = 1
    for f in factors:
        entries *= size_of[f] // split.get(f, 1)
    return tuple((axis, per_entry * entries) for axis in axes)


def splits_over_both_axes(s: Strategy, mesh: LogicalMesh) -> bool:
    """Whether some operand or result has one dim split over two mesh axes (Alpa's S01,
    a "mixed mesh shape")."""
    for layout in s.inputs + s.outputs:
        if layout is None:
            continue
        dims = [p.dim for p, n in zip(layout, mesh.shape) if is_shard(p) and n > 1]
        if len(dims) != len(set(dims)):
            return True
    return False


def replicate_only(node: OpNode, mesh: LogicalMesh) -> list[Strategy]:
    """The fallback for an op without a rule: everything whole on every device."""
    r = tuple(Replicate() for _ in range(mesh.ndim))
    return [Strategy(inputs=tuple(r for _ in node.operands),
                     outputs=tuple(r for _ in node.outputs))]


def leaf_strategies(spec: TensorSpec, mesh: LogicalMesh,
                    strides: tuple[tuple[int, int], ...] = ()) -> list[Strategy]:
    """Layouts a parameter, buffer or input may be stored in: any even split of its dims
    (and the strided splits ``strides`` allows: ``passes/sharding/strides.py``)."""
    f = FactorNamer()
    dims = f.dims(spec.shape)
    return enumerate_strategies(f.rule([], [dims]), mesh, strides=strides)
