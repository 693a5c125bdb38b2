"""Restrict layouts as a method asks: the batch kept on a mesh axis (Alpa's
``force_batch_dim_to_mesh_dim``: every op that has the batch dim shards it there),
replicated or sharded parameters, layouts pinned by name (``"*"`` on a mesh axis leaves
that axis to the ILP; a pin overrides the method's parameter preset). The ILP chooses the
rest.

Each restriction keeps the strategies that satisfy it; a request no layout satisfies is
the user's mistake (a batch that does not divide: ``BatchSplitError``; a pin that cannot
be) and raises a ValueError naming the value, what was asked and what is possible.
Parameters that cannot be split evenly stay whole under ``parameters='sharded'`` (as Alpa
allows), with a note.
"""

from __future__ import annotations

import re

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.input_errors import BatchSplitError
from torchalpa.core.opgraph import OpGraph
from torchalpa.core.options import AutoShardingOption
from torchalpa.core.placement import Partial, Replicate, Shard, is_shard, parse_placements, short
from torchalpa.passes.sharding.stage_boundary import boundary_layout
from torchalpa.passes.sharding.strategies import Strategy

__all__ = ["apply_constraints", "ViewConstraintError"]


class ViewConstraintError(ValueError):
    """The method's constraints (a pin, ``sequence_parallel``, ``plain_tensor_parallel``,
    ``force_batch_dim_to_mesh_dim``) cannot hold on this view: it has no plan at all. A
    ``ValueError``, as every refusal of what the user asked; callers that weigh views the
    user did not ask for (``parallel.fit_advice``) count such a view as refused."""


def _batch_sharded(s: Strategy, axis: int, mesh: LogicalMesh) -> bool:
    """Dim 0 split over ``axis`` (-1: every axis) and over no other axis (Alpa maps the
    batch dim to that mesh dim alone: on a (1, 4) mesh with axis 0 the batch stays whole);
    an axis of size 1 splits nothing, so any layout satisfies it there."""
    layout = s.outputs[0]
    axes = range(len(layout)) if axis == -1 else [axis]
    return all(layout[a] == Shard(0) or mesh.shape[a] == 1 for a in axes) and \
        not _split_elsewhere(layout, 0, axes, mesh)


def _split_elsewhere(layout, d: int, axes, mesh: LogicalMesh) -> bool:
    """Dim ``d`` also split over a mesh axis outside ``axes``, other than by the mixed
    layout that splits it over every axis of a mesh whose forced axis has devices (Alpa's
    1D split of a 2D mesh, which its batch filter keeps: the 1D mesh is the forced axis)."""
    others = [a for a in range(len(layout)) if a not in axes and layout[a] == Shard(d)]
    if not others:
        return False
    flattened = all(mesh.shape[a] > 1 for a in axes) and \
        all(layout[a] == Shard(d) for a in range(len(layout)) if mesh.shape[a] > 1)
    return not flattened


def _fully_sharded(s: Strategy, mesh: LogicalMesh) -> bool:
    return all(is_shard(p) or n == 1 for p, n in zip(s.outputs[0], mesh.shape))


def batch_dims(graph: OpGraph) -> dict[tuple[str, int], set[int]]:
    """For every value, the dims that carry the batch: dim 0 of the user inputs, followed
    through each op's factor rule (a result dim whose leading factor indexes a batch dim
    of an operand carries it too), forward and backward."""
    from torchalpa.passes.rules import rule_for
    carries: dict[tuple[str, int], set[int]] = {}
    for node in graph:
        if node.kind == "input":
            carries[(node.name, 0)] = {0} if node.output.shape and node.batched else set()
            continue
        if node.is_leaf:
            continue
        rule = rule_for(node, graph)
        if rule is None:
            continue
        size = rule.size_of
        batch = set()
        for ref, dims in zip(node.operands, rule.operands):
            for d in carries.get((ref.node, ref.index), ()):
                if d < len(dims) and dims[d]:
                    lead = next((f for f in dims[d] if size[f] != 1), None)
                    if lead is not None:
                        batch.add(lead)
        for j, dims in enumerate(rule.results):
            found = set()
            for d, factors in enumerate(dims):
                lead = next((f for f in factors if size[f] != 1), None)
                if lead in batch:
                    found.add(d)
            if found:
                carries[(node.name, j)] = found
    return carries


def _keeps_batch(s: Strategy, node, carries, axes, mesh: LogicalMesh) -> bool:
    """Every operand and result that carries the batch has it split over ``axes`` and over
    no other axis (an operand too: a weight gradient contracts the batch, and reads it
    split, so it sums partial gradients rather than regathering activations)."""
    layouts = [(layout, carries.get((ref.node, ref.index), ()))
               for layout, ref in zip(s.inputs, node.operands) if layout is not None]
    layouts += [(layout, carries.get((node.name, j), ())) for j, layout in enumerate(s.outputs)]
    for layout, dims in layouts:
        for d in dims:
            if any(layout[a] != Shard(d) and mesh.shape[a] > 1 for a in axes):
                return False
            if _split_elsewhere(layout, d, axes, mesh):
                return False
    return True


def _parse_pin(pattern: str, texts) -> tuple:
    """Placements of a pin; ``None`` where it says ``"*"`` (any layout on that axis),
    ``Ellipsis`` first for ``"..."`` (any layout on every leading axis)."""
    if isinstance(texts, tuple) and all(isinstance(t, str) for t in texts):
        return tuple(None if t == "*" else ... if t == "..." else parse_placements([t])[0]
                     for t in texts)
    raise ValueError(f"pin[{pattern!r}] = {type(texts).__name__}: tensor-parallel styles are "
                     "translated into placements by torchalpa.plan / auto_parallel, which see "
                     "the model's module types; when calling a method's plan() directly, pin "
                     "placements (e.g. ('...', 'S(0)') for ColwiseParallel's Linear weight)")


def _pin_matches(layout, pin) -> bool:
    if pin and pin[0] is ...:            # "...": the pin's axes are the mesh's last ones
        pin = pin[1:]
        if len(pin) > len(layout):
            return False
        layout = layout[len(layout) - len(pin):]
    return len(layout) == len(pin) and all(p is None or p == q for q, p in zip(layout, pin))


def _show_pin(pin) -> str:
    return "".join("*" if p is None else "..." if p is ... else str(p) for p in pin)


def _reduce_before_cast_up(graph: OpGraph, strategies: dict[str, list[Strategy]]) -> None:
    """``graph.meta["reduce_dtype"]`` (``MixedPrecision(reduce_dtype=...)``): a parameter
    gradient made by casting a narrow gradient up to float32 reads it summed already (no
    partial sum crosses the cast), so every gradient is reduced in the narrow dtype."""
    narrow = graph.meta.get("reduce_dtype")
    if not narrow:
        return
    for _, ref in graph.outputs.grads:
        node = graph.node(ref.node)
        while node.aliases and node.operands:       # a view of the cast's result
            node = graph.node(node.operands[0].node)
        if node.is_leaf or "_to_copy" not in node.op or not node.operands or \
                graph.spec(node.operands[0]).dtype != narrow:
            continue
        kept = [s for s in strategies[node.name]
                if s.inputs[0] is None or not any(isinstance(p, Partial) for p in s.inputs[0])]
        if kept:
            strategies[node.name] = kept


LAYER_NORM = "aten.native_layer_norm.default"


def is_norm_op(node) -> bool:
    """A forward normalization: layer norm, or an op of a module named ``*norm`` (an RMS
    norm written out: pow, mean, rsqrt, mul) on a ``(batch, seq, ...)`` activation."""
    if node.op == LAYER_NORM:
        return True
    leaf = node.module.rsplit(".", 1)[-1].lower()
    return node.phase == "forward" and leaf.endswith("norm") and len(node.outputs) == 1 \
        and len(node.outputs[0].shape) >= 3


def _split_norms_by_sequence(graph: OpGraph, strategies: dict[str, list[Strategy]],
                             mesh: LogicalMesh) -> None:
    """``sequence_parallel``: norms keep the layouts that split dim 1 over the last axis."""
    axis = mesh.ndim - 1
    if mesh.shape[axis] == 1:
        return
    for node in graph.ops():
        if not is_norm_op(node):
            continue
        kept = [s for s in strategies[node.name] if s.outputs[0][axis] == Shard(1)]
        if not kept:
            shape = list(node.outputs[0].shape)
            raise ViewConstraintError(f"sequence_parallel=True: {node.name} ({node.module or 'a norm'}) "
                             f"of shape {shape} cannot split its sequence dim over the last "
                             f"mesh axis ({mesh.shape[axis]} devices); use a sequence length "
                             "that divides by it, or sequence_parallel=False")
        strategies[node.name] = kept


def _keep_norms_whole(graph: OpGraph, strategies: dict[str, list[Strategy]],
                      mesh: LogicalMesh) -> None:
    """``plain_tensor_parallel``: norms keep the layouts whole over the last axis."""
    axis = mesh.ndim - 1
    if mesh.shape[axis] == 1:
        return
    for node in graph.ops():
        if is_norm_op(node):
            kept = [s for s in strategies[node.name]
                    if all(isinstance(out[axis], Replicate) for out in s.outputs
                           if out is not None and len(out) > axis)]
            if not kept:
                raise ViewConstraintError(f"plain_tensor_parallel=True: {node.name} "
                                 f"({node.module or 'a norm'}) has no layout whole over the "
                                 "last mesh axis; use plain_tensor_parallel=False")
            strategies[node.name] = kept


_MATMULS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.matmul.default"})
_CAST = "aten._to_copy.default"


def _read_weights_where_stored(graph: OpGraph, strategies: dict[str, list[Strategy]],
                               mesh: LogicalMesh) -> None:
    """``plain_tensor_parallel``: a matmul reads a weight split over the last axis (no
    whole layout left there, as pinned) in its split, through casts and views: Megatron's
    column- and row-parallel products, never a weight gathered over tp."""
    axis = mesh.ndim - 1

    def weight(ref):
        node = graph.node(ref.node)
        while not node.is_leaf and (node.aliases or node.op == _CAST) and node.operands:
            node = graph.node(node.operands[0].node)
        return node if node.is_param else None

    for node in graph.ops():
        if node.op not in _MATMULS:
            continue
        for slot, ref in enumerate(node.operands):
            w = weight(ref)
            if w is None or any(isinstance(s.outputs[0][axis], Replicate)
                                for s in strategies[w.name]):
                continue
            kept = [s for s in strategies[node.name]
                    if (read := s.inputs[slot]) is None or not isinstance(read[axis], Replicate)]
            if kept:
                strategies[node.name] = kept


def apply_constraints(graph: OpGraph, strategies: dict[str, list[Strategy]], mesh: LogicalMesh,
                      option: AutoShardingOption) -> list[str]:
    """Filter strategies in place; returns notes for the plan."""
    notes: list[str] = []
    pins = [(re.compile(p), _parse_pin(p, pl)) for p, pl in option.pin]
    axis = option.force_batch_dim_to_mesh_dim
    if axis is not None and not -1 <= axis < mesh.ndim:
        raise ViewConstraintError(f"force_batch_dim_to_mesh_dim={axis} but the mesh has {mesh.ndim} "
                         f"axes (use -1 for all of them)")
    for node in graph:
        if not node.is_leaf:
            continue
        name = node.target or node.name
        options = strategies[node.name]
        # a value received batch-split arrives in its one layout (stage_boundary.py): its
        # readers are held to the axis, and reshard it there if it is another
        if node.kind == "input" and node.batched and axis is not None and node.output.shape \
                and boundary_layout(graph, node.name, node.output, mesh) is None:
            kept = [s for s in options if _batch_sharded(s, axis, mesh)]
            if not kept:
                n = mesh.num_devices if axis == -1 else mesh.shape[axis]
                raise BatchSplitError(name, node.output.shape[0], n)
            options = kept
        if node.kind == "input" and not option.enable_auto_sharding and \
                boundary_layout(graph, node.name, node.output, mesh) is None:
            options = [s for s in options if all(isinstance(p, Replicate) for p in s.outputs[0])]
        if node.kind in ("param", "buffer"):
            if not option.allow_replicated_parameters and node.is_param:
                kept = [s for s in options
                        if not all(isinstance(p, Replicate) for p in s.outputs[0])]
                options = kept or options
            if option.parameters == "replicated":
                options = [s for s in options if all(isinstance(p, Replicate) for p in s.outputs[0])]
            elif option.parameters == "sharded":
                kept = [s for s in options if _fully_sharded(s, mesh)]
                if kept:
                    options = kept
                else:
                    notes.append(f"{name} {list(node.output.shape)} cannot be split evenly over "
                                 f"the mesh {mesh.shape}; it stays whole")
        for pattern, layout in pins:
            if pattern.fullmatch(name):
                kept = [s for s in options if _pin_matches(s.outputs[0], layout)] or \
                    [s for s in strategies[node.name] if _pin_matches(s.outputs[0], layout)]
                if not kept:
                    possible = ", ".join(short(s.outputs[0]) for s in strategies[node.name])
                    raise ViewConstraintError(f"{name} {list(node.output.shape)} cannot be pinned to "
                                     f"{_show_pin(layout)} on mesh {mesh.shape}; possible: {possible}")
                options = kept
        strategies[node.name] = options
    _reduce_before_cast_up(graph, strategies)
    if option.sequence_parallel:
        _split_norms_by_sequence(graph, strategies, mesh)
    if option.plain_tensor_parallel and mesh.shape[-1] > 1:
        _keep_norms_whole(graph, strategies, mesh)
        _read_weights_where_stored(graph, strategies, mesh)
    if axis is not None:
        # Alpa's semantics: every op keeps the batch on that axis where it can
        carries = batch_dims(graph)
        axes = range(mesh.ndim) if axis == -1 else [axis]
        for node in graph.ops():
            kept = [s for s in strategies[node.name] if _keeps_batch(s, node, carries, axes, mesh)]
            if kept:
                strategies[node.name] = kept
    return notes
