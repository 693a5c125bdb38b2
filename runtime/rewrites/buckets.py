"""Bucketed gradient collectives: one all-reduce (or reduce-scatter) per bucket of gradients.

A lowered ``reduce_grads`` program reshards each gradient on its own: a plan that is DDP's
issues one all-reduce per parameter, and on a network each pays a latency (150 for
GPT-2 small, where DDP issues a handful). DDP packs gradients into buckets of about
25 MiB; this module does the same to the plan's gradient collectives:

- ``gradient_buckets(plan)`` groups the gradients whose final resharding starts with an
  all-reduce or a reduce-scatter, by mesh axis, reduce op, element size (and scattered
  dim) and by the all-reduces over other axes that follow it (``plan.bucketed_prefix``: a
  gradient summed over both axes of a 2-D mesh goes through two bucketed all-reduces, one
  per axis, as Alpa's all-reduce combiner makes them), in the order backward produces them
  (the reverse of the parameters'), into buckets of at most ``all_reduce_threshold`` bytes
  (the plan's option; when unset, DDP's sizes: 1 MiB for the first bucket of each kind, so
  reduction starts early in backward, 25 MiB for the others; 0 for no buckets).
  Only buckets of two or more gradients form.
- ``fuse_gradient_buckets(gm, buckets, grad_names)`` rewrites a ``reduce_grads`` program:
  the members of a bucket are flattened and concatenated, reduced by one collective per
  bucketed step (an all-reduce in place: the flat buffer is the bucket's own, so it is
  not copied again as DDP does not copy its bucket) and split back into views of their
  shapes. It is a pass over the program,
  so intra-op and pipeline-stage programs alike get it.
- ``issued_collectives(plan, num_micro_batches)`` is the list a step really issues (the
  plan's collectives with each bucket's members replaced by the bucket): what
  ``runtime.measurement.comm_count`` must count. With ``loss_in_bucket`` (``runtime.rewrites.loss_in_bucket``:
  a ``train_step`` whose loss is all-reduced inside a bucket), that collective's bytes are
  listed in its bucket's and it is not listed on its own.

Reduction is elementwise, so reducing a concatenation equals concatenating the reductions:
the gradients are the same sums as with one collective each, up to the order the ranks'
parts are added in (gloo's ring all-reduce picks it by an element's place in the buffer: on
4 ranks a scalar summed alone and at the end of a 30001-element buffer differed in the last
bit 86 times in 200).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from torchalpa.core.placement import local_shape, split_factor_of
from torchalpa.core.plan import OUTPUT, OutputSlot, Plan, bucketed_prefix
from torchalpa.runtime.execution import collectives as C

__all__ = ["DEFAULT_BUCKET_BYTES", "FIRST_BUCKET_BYTES", "GradientBucket", "BucketStage",
           "bucket_threshold", "gradient_buckets",
           "fuse_gradient_buckets", "flatten_concat", "split_flat", "bucket_shapes",
           "interleave_chunks", "split_chunks", "BUCKET", "collective_position", "LossInBucket",
           "is_gradient"]

BUCKET = "torchalpa_bucket"     # ``node.meta`` key of a bucket's packing: its index

DEFAULT_BUCKET_BYTES = 25 * 2 ** 20   # torch DDP's bucket_cap_mb default
FIRST_BUCKET_BYTES = 2 ** 20          # torch DDP's first bucket (_DEFAULT_FIRST_BUCKET_BYTES)


@dataclass(frozen=True, slots=True)
class BucketStage:
    """An all-reduce over another mesh axis that a bucket's reduced buffer goes through
    next (every member's gradient has it right after the bucket's previous step)."""

    axis: int
    reduce_op: str
    positions: tuple[int, ...]   # the members' collectives of this step in ``plan.collectives``
    bytes: int                   # what this rank contributes (sum of the members)


@dataclass(frozen=True, slots=True)
class GradientBucket:
    """Gradients reduced by one collective, in the order they are packed."""

    kind: str                    # "all_reduce" | "reduce_scatter"
    axis: int
    reduce_op: str
    dim: int | None              # reduce_scatter: the scattered dim of every member
    params: tuple[str, ...]      # parameter names of the member gradients
    positions: tuple[int, ...]   # the members' collectives in ``plan.collectives``
    bytes: int                   # what this rank contributes (sum of the members)
    itemsize: int = 0            # bytes per element of every member
    then: tuple[BucketStage, ...] = ()   # later all-reduces of the whole buffer, in order


def bucket_threshold(plan: Plan) -> int:
    """Bytes per bucket: the plan's ``all_reduce_threshold``, DDP's 25 MiB when unset."""
    threshold = _option_threshold(plan)
    return DEFAULT_BUCKET_BYTES if threshold is None else threshold


def _option_threshold(plan: Plan) -> int | None:
    option = (plan.method or {}).get("auto_sharding_option") or {}
    threshold = option.get("all_reduce_threshold")
    return None if threshold is None else int(threshold)


def is_gradient(consumer, slot) -> bool:
    """Whether a reshard is a gradient's final resharding (an output slot of kind grad)."""
    return consumer == OUTPUT and isinstance(slot, OutputSlot) and slot.kind == "grad"


def _grad_reshards(plan: Plan):
    """(parameter name, bucketed steps, their positions in plan.collectives) for every
    gradient whose final resharding starts with steps a bucket carries
    (``plan.bucketed_prefix``), in plan order."""
    position = -1                 # plan.collectives lists the reshards' collective steps in order
    out = []
    for r in plan.reshards:
        first = position + 1
        position += sum(1 for s in r.steps if s.is_collective)
        if not is_gradient(r.consumer, r.slot):
            continue
        count = bucketed_prefix(r.steps, plan.mesh_shape)
        if count:                 # every bucketed step is a collective: positions follow
            assert isinstance(r.slot, OutputSlot)
            out.append((r.slot.name, r.steps[:count], tuple(range(first, first + count))))
    return out


def _signature(steps) -> tuple:
    """What the members of one bucket share: each bucketed step's kind, axis, reduce op
    (and a reduce-scatter's dim)."""
    return tuple((s.kind, s.axis, s.reduce_op, s.dim if s.kind != "all_reduce" else None)
                 for s in steps)


def _itemsize(plan: Plan, param: str, step) -> int | None:
    """Bytes per element of the gradient entering ``step`` (None if it does not divide)."""
    try:
        shape = plan.parameter(param).shape
    except KeyError:
        return None
    numel = math.prod(local_shape(shape, step.src, plan.mesh_shape))
    if numel == 0 or step.bytes % numel:
        return None
    return step.bytes // numel


def gradient_buckets(plan: Plan, threshold: int | None = None) -> tuple[GradientBucket, ...]:
    """The plan's gradient collectives packed into buckets of at most ``threshold`` bytes
    (default: the plan's option, else DDP's 1 MiB first bucket and 25 MiB ones after it);
    gradients that share no bucket are left out."""
    first_threshold = threshold
    if threshold is None:
        threshold = bucket_threshold(plan)
        first_threshold = FIRST_BUCKET_BYTES if _option_threshold(plan) is None else threshold
    assert first_threshold is not None
    if threshold < 0:
        raise ValueError(f"bucket threshold must be >= 0 bytes, got {threshold}")
    open_buckets: dict[tuple, list] = {}
    first_of: dict[tuple, list] = {}
    closed: list[list] = []
    for param, steps, positions in reversed(_grad_reshards(plan)):   # backward's order
        step = steps[0]
        size = _itemsize(plan, param, step)
        if size is None or split_factor_of(step.dst[step.axis]) > 1:
            continue   # a strided shard's pieces are reordered around its own collective
        key = (_signature(steps), size)
        members = open_buckets.get(key)
        cap = first_threshold if members is first_of.get(key) else threshold
        if members is None or sum(s[0].bytes for _, s, _ in members) + step.bytes > cap:
            members = open_buckets[key] = []
            first_of.setdefault(key, members)
            closed.append(members)
        members.append((param, steps, positions))
    return tuple(_bucket(plan, m) for m in closed if len(m) > 1)


def _bucket(plan: Plan, members: list) -> GradientBucket:
    """The bucket of ``members``: (parameter, bucketed steps, their positions) each."""
    param, steps, _ = members[0]
    first = steps[0]
    return GradientBucket(
        kind=first.kind, axis=first.axis, reduce_op=first.reduce_op or "sum",
        dim=first.dim if first.kind == "reduce_scatter" else None,
        params=tuple(p for p, _, _ in members), positions=tuple(i[0] for _, _, i in members),
        bytes=sum(s[0].bytes for _, s, _ in members),
        itemsize=_itemsize(plan, param, first) or 0,
        then=tuple(BucketStage(axis=later.axis, reduce_op=later.reduce_op or "sum",
                               positions=tuple(i[k] for _, _, i in members),
                               bytes=sum(s[k].bytes for _, s, _ in members))
                   for k, later in enumerate(steps[1:], start=1)))


@dataclass(frozen=True, slots=True)
class LossInBucket:
    """A ``train_step``'s loss all-reduce sent inside a gradient bucket's all-reduce
    (``runtime.rewrites.loss_in_bucket``): the collective at ``position`` of ``plan.collectives``
    travels in bucket ``bucket`` of ``gradient_buckets(plan)``."""

    position: int
    bucket: int


def collective_position(plan: Plan, consumer, slot, index: int) -> int | None:
    """The position in ``plan.collectives`` of step ``index`` of the reshard
    ``(consumer, slot)`` (None: no such reshard, or that step is no collective)."""
    position = 0
    for r in plan.reshards:
        if (r.consumer, r.slot) == (consumer, slot):
            if index >= len(r.steps) or not r.steps[index].is_collective:
                return None
            return position + sum(1 for s in r.steps[:index] if s.is_collective)
        position += sum(1 for s in r.steps if s.is_collective)
    return None



# -- the run-time halves of a bucket (plain torch ops: printable, compilable) ---------------

def flatten_concat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat buffer holding every tensor, in order."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"a gradient bucket mixes dtypes {sorted(map(str, dtypes))}; set "
                        "AutoShardingOption(all_reduce_threshold=0) to reduce each on its own")
    return torch.cat([t.reshape(-1) for t in tensors])


def bucket_shapes(tensors: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    """The shapes of a bucket's tensors, read where it is packed: the split after its
    collective needs only them, so each gradient can be freed once packed."""
    return [tuple(t.shape) for t in tensors]


def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t)


def split_flat(flat: torch.Tensor, like: Sequence) -> list[torch.Tensor]:
    """``flat`` cut back into tensors shaped like ``like`` (tensors or their shapes;
    views of ``flat``)."""
    shapes = [_shape(t) for t in like]
    parts = torch.split(flat, [math.prod(s) for s in shapes])
    return [p.view(s) for p, s in zip(parts, shapes)]


def interleave_chunks(tensors: Sequence[torch.Tensor], dim: int, group_size: int
                      ) -> torch.Tensor:
    """One flat buffer whose ``i``-th of ``group_size`` equal parts holds block ``i`` (of
    ``dim``) of every tensor: reduce-scattering it leaves each rank its blocks. Each block
    is copied into its place once (no stacked copy of every tensor beside the buffer)."""
    flat_dtypes = {t.dtype for t in tensors}
    if len(flat_dtypes) != 1:
        raise TypeError(f"a gradient bucket mixes dtypes {sorted(map(str, flat_dtypes))}; set "
                        "AutoShardingOption(all_reduce_threshold=0) to reduce each on its own")
    widths = [t.numel() // group_size for t in tensors]
    first = tensors[0]
    rows = torch.empty(group_size, sum(widths), dtype=first.dtype, device=first.device)
    start = 0
    for t, width in zip(tensors, widths):
        for i, block in enumerate(torch.chunk(t, group_size, dim=dim)):
            rows[i, start:start + width].view(block.shape).copy_(block)
        start += width
    return rows.reshape(-1)


def split_chunks(flat: torch.Tensor, like: Sequence, dim: int, group_size: int
                 ) -> list[torch.Tensor]:
    """This rank's block of each tensor shaped like ``like`` (tensors or their shapes)
    from a reduce-scattered buffer."""
    shapes = []
    for t in like:
        shape = list(_shape(t))
        shape[dim] //= group_size
        shapes.append(shape)
    parts = torch.split(flat, [math.prod(s) for s in shapes])
    return [p.view(s) for p, s in zip(parts, shapes)]


# -- the pass -----------------------------------------------------------------------------

def _chain(member: fx.Node, first_target, later: int) -> list[fx.Node]:
    """The collective calls a gradient goes through in a bucket: its one ``first_target``
    call, then ``later`` all-reduces, each the only user of the one before."""
    users = [u for u in member.users if u.op == "call_function" and u.target is first_target]
    assert len(users) == 1, f"gradient {member.name}: expected one {first_target}, got {users}"
    chain = users
    for _ in range(later):
        nxt = list(chain[-1].users)
        assert len(nxt) == 1 and nxt[0].target is C.all_reduce, \
            f"gradient {member.name}: expected an all-reduce after {chain[-1]}, got {nxt}"
        chain.append(nxt[0])
    return chain


def _placeholders_first(graph: fx.Graph, placeholders: list[fx.Node]) -> None:
    """Move every placeholder before the first other node (their order kept), so a bucket
    can be inserted where its first member was reduced, after all its members exist."""
    anchor = next((n for n in graph.nodes if n.op != "placeholder"), None)
    if anchor is None:
        return
    for p in placeholders:
        anchor.prepend(p)


def fuse_gradient_buckets(gm: fx.GraphModule, buckets: Sequence[GradientBucket],
                          grad_names: Sequence[str], *, group_sizes: Sequence[int]
                          ) -> fx.GraphModule:
    """Rewrite ``gm`` (in place), a program whose placeholders are the gradients of
    ``grad_names`` in order: the first collective applied to the members of each bucket
    becomes one collective over their concatenation.

    ``group_sizes``: the mesh shape (reduce-scatter splits by it)."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(grad_names), (len(placeholders), len(grad_names))
    by_name = dict(zip(grad_names, placeholders))
    _placeholders_first(graph, placeholders)
    target = {"all_reduce": C.all_reduce, "reduce_scatter": C.reduce_scatter}
    changed = False
    for index, bucket in enumerate(buckets):
        if any(p not in by_name for p in bucket.params):
            continue              # a gradient the program does not take (not produced)
        members = [by_name[p] for p in bucket.params]
        chains = [_chain(m, target[bucket.kind], len(bucket.then)) for m in members]
        collectives = [c[0] for c in chains]
        group = collectives[0].args[-1]
        groups = [c.args[-1] for c in chains[0]]
        assert all([c.args[-1] for c in chain] == groups for chain in chains), \
            "a bucket spans process groups"
        first = min(collectives, key=lambda n: list(graph.nodes).index(n))
        n = group_sizes[bucket.axis]
        with graph.inserting_before(first):
            # the split reads the shapes, read here: the gradients die once packed
            shapes = graph.call_function(bucket_shapes, (members,))
            if bucket.kind == "all_reduce":
                flat = graph.call_function(flatten_concat, (members,))
                flat.meta[BUCKET] = index     # a loss may travel in it (runtime.rewrites.loss_in_bucket)
                # in place: the flat buffer is made for this collective alone
                reduced = graph.call_function(C.all_reduce, (flat, bucket.reduce_op, group),
                                              {"in_place": True})
            else:
                flat = graph.call_function(interleave_chunks, (members, bucket.dim, n))
                reduced = graph.call_function(C.reduce_scatter,
                                              (flat, 0, bucket.reduce_op, n, group))
            for stage, stage_group in zip(bucket.then, groups[1:]):
                reduced = graph.call_function(C.all_reduce,
                                              (reduced, stage.reduce_op, stage_group),
                                              {"in_place": True})
            if bucket.kind == "all_reduce":
                parts = graph.call_function(split_flat, (reduced, shapes))
            else:
                parts = graph.call_function(split_chunks, (reduced, shapes, bucket.dim, n))
            outs = [graph.call_function(operator.getitem, (parts, i))
                    for i in range(len(members))]
        for chain, out in zip(chains, outs):
            chain[-1].replace_all_uses_with(out)
            for c in reversed(chain):
                graph.erase_node(c)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm
