"""Per-device memory of a plan: model states plus activations alive at each point.

Model states are each parameter's local shard and the optimizer's state tensors (same
layout), alive throughout, and its gradient (same layout): alive throughout where the
step accumulates gradients over micro-batches (they live from the first micro-batch's
backward to the optimizer step, across the next micro-batches' forwards), else from the
op that makes it to the optimizer step (``grads_from_backward``: one interval named by
the parameter in ``Liveness``). Activations are op results
(and user inputs) held from the op that makes them to their last reader, in the step's
order (forward then backward); a view of one shares its storage and keeps it alive, and so
does a write made in place into it (``buffer_reuse.py``). On CPU ranks an attention forward
whose backward the lowering rewrites to read saved statistics (``saved_statistics``,
``passes/pricing/attention_price.py``) holds its output and its float32 log-sum-exp per query row
until that backward.

With one micro-batch a gradient's raw result (as its op lays it out) lives to backward's
end too, beside the reduced one where a reduce-scatter shrinks it (``Liveness.raw_of``).
The step's end, its optimizer step, is priced apart (``step_end.py``): with an optimizer
``MemoryModel`` gives it one more point, ``end``.

``Liveness`` holds the intervals; the ILP adds one constraint per point it checks,
``model states + activations alive there <= budget``, starting from the likely peaks and
adding the actual peak of each solution until the plan fits (``passes/sharding/intra_op.py``).
Each row counts what the estimate counts for the plan the solver picks
(``MemoryModel.rows_bytes``; ``tests/test_memory_rows.py``): bytes that depend on two
nodes' choices (``MemoryModel.paired_entries``) enter as pair terms, not at their most.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from torchalpa.core.cluster import GRADIENT_BUCKET_BYTES
from torchalpa.core.opgraph import OpGraph, ValueRef
from torchalpa.core.placement import Partial, Placements, Replicate, is_shard
from torchalpa.passes.pricing.attention_price import saves_statistic, statistic_spec
from torchalpa.passes.pricing.buffer_reuse import in_place_root
from torchalpa.passes.pricing.fused_pricing import recomputed
from torchalpa.passes.pricing.gathered_views import copy_bytes, held_copies, saved_view_spans
from torchalpa.passes.pricing.grad_buckets import bucket_members, packing_points
from torchalpa.passes.pricing.state_gather import state_gather, state_gather_bytes
from torchalpa.passes.pricing.step_end import end_of_step_bytes, step_end
from torchalpa.passes.pricing.sum_reduction import sum_reduction, sum_reduction_bytes
from torchalpa.passes.sharding.reshard import local_bytes
from torchalpa.passes.sharding.stage_boundary import summed_part

__all__ = ["Liveness", "KeptCopy", "KeptTerm", "liveness", "model_state_bytes", "activation_peak_bytes",
           "accumulated_gradients", "summed_gradients", "same_layout_views",
           "state_copies", "gradients_from_backward", "forward_end", "in_flight_bytes", "value_bytes",
           "view_copies", "viewed_leaf", "scatter_copies"]


@dataclass
class Liveness:
    """Op results as intervals ``[start, end]`` over the step's order of nodes.

    Entry ``i`` is result ``results[i]`` of node ``names[i]``, or all of the node's
    results where that is None. A node whose results die at different points (batch
    norm's normalized output, read by the next op, beside the mean and inverse deviation
    its backward reads) has one entry per result; others one entry for the node."""

    names: list[str]          # values that count as activations
    start: np.ndarray
    end: np.ndarray
    length: int
    results: list[int | None] = field(default_factory=list)
    raw_of: dict[int, int] = field(default_factory=dict)
    """With ``grads_from_backward``: the entry of a parameter's reduced gradient (named by
    the parameter) -> the entry of the raw gradient it is reduced from (the op's result,
    as the op lays it out). The raw one lives to the end of backward: a gradient
    reduce-scattered there is packed into its bucket, held by the collective in flight
    until backward's last wait, beside the block it leaves (``runtime/rewrites/
    reduce_in_backward.py``); one all-reduced in place, or not reduced, is the same
    storage as its reduced self (``_entry_bytes`` then counts it once)."""

    transient_of: dict[int, tuple[int, int]] = field(default_factory=dict)
    """With ``grads_from_backward``: an entry of one point, where the parameter's gradient
    bucket is packed (its last member made: ``grad_buckets.packing_points``) -> (its raw
    entry, its reduced entry): the copies the reduction makes of a gradient a
    reduce-scatter shrinks, as its bucket is packed (``scatter_copies``; nothing where the
    raw and reduced gradients are one storage). A bucket's members all count there."""

    kept_of: dict[int, tuple[int, int]] = field(default_factory=dict)
    """With ``grads_from_backward``, a gradient in a bucket of two or more: its reduced
    entry -> (its raw gradient after the bucket's packing, its reduced gradient before the
    op that makes it), each an entry of its own (the raw entry ends at the packing). An
    all-reduced bucket (its members partial sums of their reduced size) is packed into a
    flat buffer the runtime keeps from step to step (``runtime/rewrites/kept_buckets.py``),
    whose views the reduced gradients are: held from the step's start, beside the raw
    members until they are packed, which then die. Otherwise the raw gradient is held to
    backward's end (the packed buffer, gloo's copy) and the head holds nothing."""

    def __post_init__(self):
        if len(self.results) != len(self.names):
            self.results = [None] * len(self.names)

    def alive(self, t: int) -> list[int]:
        """Entries alive at point ``t``."""
        return [int(i) for i in np.flatnonzero((self.start <= t) & (t <= self.end))]

    def entries(self) -> list[tuple[str, int | None]]:
        """(node, result or None for all of them) of each entry."""
        return list(zip(self.names, self.results))

    def total(self, sizes) -> np.ndarray:
        """Bytes alive at each point, value ``names[i]`` holding ``sizes[i]``."""
        delta = np.zeros(self.length + 1)
        np.add.at(delta, self.start, sizes)
        np.add.at(delta, self.end + 1, -np.asarray(sizes, dtype=float))
        return np.cumsum(delta)[:-1]


def liveness(graph: OpGraph, kept_for: dict[str, str] | None = None,
             state_at_start: bool = False, grads_from_backward: bool = False,
             fused: bool | None = None,
             bucket_bytes: float = GRADIENT_BUCKET_BYTES) -> Liveness:
    """When each value is allocated and freed, in the step's order.

    Each result of an op is freed after its own last reader, as the runtime's programs
    (and eager autograd) free it: of batch norm's three results forward's next op reads
    the output and backward the saved mean and inverse deviation, so the output is not
    held into backward. Parameters' gradients are model state, not activations; the
    other results of the op that makes one are activations (a convolution's backward
    makes its input's gradient beside its weight's). A view (``OpNode.aliases``)
    allocates nothing: it keeps the storage it views alive until its own last reader, so
    it extends that tensor's interval instead of adding one; so does a write into a
    buffer nothing reads afterwards, which the runtime makes in place
    (``buffer_reuse.in_place_root``: a scatter into its zeros). Views of parameters and
    buffers are the exception: a layer often reads a weight through a view (``permute``)
    in a layout other than the weight's own (gathered under ZeRO), and forward keeps
    that copy for backward, so such views keep intervals of their own. (A view that
    reads an activation resharded is priced in the activation's layout: resharding
    temporaries are not modeled.) ``kept_for``: value -> a later op that reads it
    outside the graph's edges (attention's saved output). ``state_at_start``
    (``plan.state_read_once``): the step reshards parameters for forward once, before
    its first micro-batch, so a forward view of a parameter holds its copy from the
    start of the step. ``grads_from_backward`` (a step of one micro-batch): each
    parameter's gradient is an entry of its own, named by the parameter (the gradient
    has its layout), from the op that makes it to the end of the step, where the
    optimizer reads it; without it gradients are model state (``state_copies``).
    ``fused`` (default: ``graph`` priced ``elementwise="fused"``): a value compiled kernels
    never hold (``fused_pricing.recomputed``) allocates nothing; what it is made from lives
    to its last reader instead. ``bucket_bytes``: the runtime's gradient bucket cap
    (``grad_buckets.packing_points``), where ``grads_from_backward`` places each
    reduction's transient copy."""
    fused = graph.meta.get("elementwise") == "fused" if fused is None else fused
    bucket_bytes = bucket_bytes if grads_from_backward else GRADIENT_BUCKET_BYTES
    key = (tuple(sorted((kept_for or {}).items())), state_at_start, grads_from_backward, fused,
           graph.meta.get("frontend"), bucket_bytes)
    memo = _LIVENESS.setdefault(graph, {})
    found = memo.get(key)
    if found is None:
        found = memo[key] = _liveness(graph, kept_for, state_at_start, grads_from_backward, fused,
                                      bucket_bytes)
    return found


_LIVENESS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""graph -> (what ``liveness`` reads besides the graph's nodes) -> its answer: the memory
model of each solve of a view, each plan's estimate and the bounds ask for the same
intervals of one graph (9 times for one candidate on three views). ``Liveness`` is
read-only to every caller."""


def _liveness(graph: OpGraph, kept_for: dict[str, str] | None, state_at_start: bool,
              grads_from_backward: bool, fused: bool, bucket_bytes: float) -> Liveness:
    """``liveness``, computed."""
    recompute = recomputed(graph) if fused else {}
    order = {n.name: i for i, n in enumerate(graph)}
    last_use: dict[tuple[str, int], int] = {}

    def use(node: str, index: int, at: int) -> None:
        last_use[node, index] = max(last_use.get((node, index), -1), at)

    for node in graph:
        for ref in node.operands:
            use(ref.node, ref.index, order[node.name])
    for value, reader in (kept_for or {}).items():
        for k in range(len(graph.node(value).outputs)):
            use(value, k, order[reader])
    end_of_step = len(order)
    for ref in graph.outputs.refs():
        use(ref.node, ref.index, end_of_step)
    storage = _storage_roots(graph, last_use, order, set(recompute))
    for view, root in storage.items():      # a view's results share its root's storage
        seen = [last_use.get((view, k), order[view])
                for k in range(len(graph.node(view).outputs))]
        use(root.node, root.index, max(seen))
    for name, sources in recompute.items():  # its readers read what it is made from
        last = max(last_use.get((name, k), order[name])
                   for k in range(len(graph.node(name).outputs)))
        for src in sources:
            use(src.node, src.index, last)
    grads = {(ref.node, ref.index) for _, ref in graph.outputs.grads}
    # a gradient that is a view (a linear layer's weight gradient, ``t`` of a matmul):
    # the result it views is the gradient's storage, priced as the gradient, not again
    grads |= {(storage[node].node, storage[node].index) for node, _ in grads if node in storage}
    names, results, start, end = [], [], [], []
    for n in graph:
        if n.kind not in ("op", "input") or n.name in storage or n.name in recompute:
            continue
        first = _arrival(graph, n, order, state_at_start)
        ends = [last_use.get((n.name, k), order[n.name]) for k in range(len(n.outputs))]
        split = n.is_grad or len(set(ends)) > 1 or \
            any((n.name, k) in grads for k in range(len(n.outputs)))
        for k, last in (enumerate(ends) if split else [(None, max(ends))]):
            if (n.name, k) in grads:
                continue        # a parameter's gradient: model state, or its own entry
            names.append(n.name)
            results.append(k)
            start.append(first)
            end.append(last)
    raw_of: dict[int, int] = {}
    made: list[tuple[int, int, int]] = []      # per gradient: where, bytes whole, item size
    gradient_of: dict[int, int] = {}           # reduced entry -> its gradient in ``made``
    if grads_from_backward:
        params = {n.target: n.name for n in graph if n.kind == "param"}
        for target, ref in graph.outputs.grads:
            if target in params:
                raw = storage.get(ref.node, ref)
                spec = graph.spec(raw)
                made.append((order[ref.node], spec.nbytes, spec.itemsize))
                if graph.node(raw.node).kind == "op" and raw.node not in recompute:
                    names.append(raw.node)
                    results.append(raw.index)
                    start.append(order[raw.node])
                    end.append(end_of_step)
                    raw_of[len(names)] = len(names) - 1
                    gradient_of[len(names)] = len(made) - 1
                names.append(params[target])
                results.append(None)
                start.append(order[ref.node])
                end.append(end_of_step)
    packed = packing_points(made, bucket_bytes)
    transient_of = _add_transients(names, results, start, end, raw_of,
                                   {r: packed[g] for r, g in gradient_of.items()})
    shared = {j for members in bucket_members([(b, i) for _, b, i in made], bucket_bytes)
              if len(members) > 1 for j in members}
    kept_of = _add_kept(names, results, start, end, raw_of,
                        {r: packed[g] for r, g in gradient_of.items() if g in shared})
    starts, ends = np.array(start, dtype=np.int64), np.array(end, dtype=np.int64)
    starts.setflags(write=False)
    ends.setflags(write=False)
    return Liveness(names, starts, ends, end_of_step + 1, results, raw_of, transient_of, kept_of)


def _add_transients(names: list, results: list, start: list, end: list,
                    raw_of: dict[int, int], packed_at: dict[int, int]) -> dict[int, tuple[int, int]]:
    """Append one entry per reduced gradient of ``raw_of`` for the reduction's transient
    copy of its raw gradient, at the point its bucket is packed (``packed_at``: reduced
    entry -> point); return them as ``Liveness.transient_of``."""
    transient_of: dict[int, tuple[int, int]] = {}
    for reduced, raw in list(raw_of.items()):
        transient_of[len(names)] = (raw, reduced)
        names.append(names[raw])
        results.append(results[raw])
        start.append(packed_at[reduced])
        end.append(packed_at[reduced])
    return transient_of


def _add_kept(names: list, results: list, start: list, end: list, raw_of: dict[int, int],
              packed_at: dict[int, int]) -> dict[int, tuple[int, int]]:
    """For each reduced gradient of ``packed_at`` (reduced entry -> where its bucket of
    two or more is packed, an op's point, before the step's end): its raw entry ends
    there, and two entries are appended, its raw gradient after the packing and its
    reduced one before its op; return them as ``Liveness.kept_of``."""
    kept_of: dict[int, tuple[int, int]] = {}
    for reduced, at in packed_at.items():
        raw = raw_of[reduced]
        if start[reduced] < 1 or at >= end[raw]:
            continue
        tail, head = len(names), len(names) + 1
        names += [names[raw], names[reduced]]
        results += [results[raw], results[reduced]]
        start += [at + 1, 0]
        end += [end[raw], start[reduced] - 1]
        end[raw] = at
        kept_of[reduced] = (tail, head)
    return kept_of


def _arrival(graph: OpGraph, node, order: dict[str, int], state_at_start: bool) -> int:
    """Where ``node``'s value comes to be: at its place in the step; a forward view of a
    parameter at the step's start where ``state_at_start`` (``liveness``); a value another
    stage sends in backward arrives when the runtime receives it
    (``runtime/execution/step.py``, ``StepRunner._backward``; ``runtime/execution/
    pipeline.py``, ``StageExchange``): a gradient sent per micro-batch right before that
    micro-batch's backward, where forward ends (so the micro-batches waiting for backward
    hold none), and a gradient part sent summed once per step (``stage_boundary.
    summed_part``) after the stage's last backward (``StageExchange.finish``): at its
    first reader, so no micro-batch in flight is counted holding it."""
    if state_at_start and _views_state(graph, node.name):
        return 0
    if node.kind == "input" and node.phase == "backward":
        if summed_part(graph, node.name):
            return min(order[c] for c in graph.consumers(node.name))
        return forward_end(graph) + 1     # a few received values a stage: O(n) each
    return order[node.name]


def _views_state(graph: OpGraph, name: str) -> bool:
    """Whether ``name`` is a forward view of a parameter or buffer."""
    node = graph.node(name)
    return node.aliases and node.phase == "forward" and bool(node.operands) and \
        graph.node(node.operands[0].node).kind in ("param", "buffer")


def viewed_leaf(graph: OpGraph, name: str) -> str | None:
    """The parameter or buffer op ``name`` is a view of (its first operand), else None."""
    node = graph.node(name)
    if node.kind != "op" or not node.aliases or not node.operands:
        return None
    leaf = node.operands[0].node
    return leaf if graph.node(leaf).kind in ("param", "buffer") else None


def _storage_roots(graph: OpGraph, last_use: dict[tuple[str, int], int],
                   order: dict[str, int], never_held: set[str]) -> dict[str, ValueRef]:
    """Each view of an activation, and each result written into an operand's buffer
    (``buffer_reuse.in_place_root``: a scatter into zeros nothing else reads), -> the
    result whose storage it shares. ``last_use``: the points that read each value."""
    roots: dict[str, ValueRef] = {}
    sharing: dict[ValueRef, list[str]] = {}
    for node in graph.ops():
        if node.aliases:
            base = node.operands[0]
            root = roots.get(base.node, base)
            if graph.node(root.node).kind in ("param", "buffer"):
                continue
        else:
            found = in_place_root(graph, node, roots, sharing, last_use, order, never_held)
            if found is None:
                continue
            root = found
        roots[node.name] = root
        sharing.setdefault(root, []).append(node.name)
    return roots


def gradients_from_backward(micro_batches: int, optimizer_states: int) -> bool:
    """Whether a step's gradients live only from the backward op that makes each to the
    optimizer step (``grads_from_backward``): a step of one micro-batch, whose runtime
    makes them in backward and the optimizer reads them at the end. With gradient
    accumulation (``micro_batches`` > 1, a pipeline stage's too) they are summed across
    the micro-batches, alive for the whole step; with parameters offloaded
    (``PARAMETERS_OFFLOADED``, negative ``optimizer_states``) they are not on the device."""
    return micro_batches == 1 and optimizer_states >= 0


def state_copies(graph: OpGraph, node_name: str, optimizer_states: int,
                 grads_from_backward: bool = False) -> int:
    """Tensors of a leaf's layout held for the whole step: itself, grad (not with
    ``grads_from_backward``: ``liveness`` holds it from its op on), optimizer states; none
    of a trained parameter whose parameter, gradient and states are offloaded (negative
    ``optimizer_states``; the copies streamed per op are reserved apart)."""
    node = graph.node(node_name)
    if node.kind == "param" and node.target in dict(graph.outputs.grads):
        if optimizer_states < 0:        # PARAMETERS_OFFLOADED: all of them on the host
            return 0
        return 1 + optimizer_states + (not grads_from_backward)
    return 1 if node.kind in ("param", "buffer") else 0


def model_state_bytes(graph: OpGraph, placements: dict[str, Placements], mesh_shape,
                      optimizer_states: int, grads_from_backward: bool = False,
                      outputs: dict[str, tuple[Placements, ...]] | None = None) -> int:
    """Params + grads (not with ``grads_from_backward``) + optimizer states held by one
    device for the whole step. ``outputs`` (node -> its results' layouts, the plan's):
    the gradients summed over micro-batches are held as the ops that make them lay them
    out (``accumulated_gradients``), else in their parameters' layouts."""
    raw = summed_gradients(graph, optimizer_states, grads_from_backward, outputs) \
        if outputs is not None else {}
    total = sum(local_bytes(n.output, placements[n.name], mesh_shape)
                * state_copies(graph, n.name, optimizer_states, grads_from_backward or
                               n.name in raw)
                for n in graph if n.kind in ("param", "buffer"))
    return total + sum(local_bytes(graph.node(ref.node).outputs[ref.index],
                                   outputs[ref.node][ref.index], mesh_shape)
                       for ref in raw.values() if outputs is not None)


def summed_gradients(graph: OpGraph, optimizer_states: int, grads_from_backward: bool,
                     outputs=None) -> dict[str, ValueRef]:
    """The gradients a device holds summed over micro-batches, as their ops lay them out
    (``accumulated_gradients``): none with ``grads_from_backward``, nor with parameters
    offloaded (negative ``optimizer_states``), whose gradients go to the host as backward
    makes them. Counted both by plans' estimates and by the ILP's ``MemoryModel``."""
    if grads_from_backward or optimizer_states < 0:
        return {}
    return accumulated_gradients(graph, outputs)


def accumulated_gradients(graph: OpGraph, outputs=None) -> dict[str, ValueRef]:
    """Parameter -> the op result that is its gradient, where the step sums it over
    micro-batches as that op lays it out: the runtime adds each micro-batch's raw
    gradient to the sum (``runtime/execution/step.py``, ``StepRunner._backward``) and
    reshards the sum to the parameter's layout once, at the step's end (``reduce_grads``).
    So with data parallelism the sum is a partial one, whole over the data-parallel axis,
    even where the parameter (ZeRO) is split over it. Only op results the plan lays out
    (in ``outputs`` where given)."""
    params = {n.target: n.name for n in graph if n.kind == "param"}
    return {params[target]: ref for target, ref in graph.outputs.grads
            if target in params and graph.node(ref.node).kind == "op"
            and (outputs is None or ref.node in outputs)}


def value_bytes(graph: OpGraph, name: str, placements: tuple[Placements, ...], mesh_shape,
                statistics: frozenset[str] | dict = frozenset(),
                result: int | None = None) -> int:
    """Bytes one device holds for op ``name``'s results in ``placements`` (only result
    ``result`` where given), plus the attention statistic it saves (with its first
    result) when ``name`` is in ``statistics`` and the fused kernel computes it (split
    like the output's batch, heads and rows; whole where the output splits its features)."""
    node = graph.node(name)
    total = sum(local_bytes(spec, placements[k], mesh_shape)
                for k, spec in enumerate(node.outputs) if result in (None, k))
    if result in (None, 0) and name in statistics and saves_statistic(graph, node):
        spec = statistic_spec(node)
        rows = tuple(p if not is_shard(p) or p.dim < len(spec.shape) else Replicate()
                     for p in placements[0])
        total += local_bytes(spec, rows, mesh_shape)
    return total


def _entry_bytes(graph: OpGraph, live: Liveness, outputs: dict[str, tuple[Placements, ...]],
                 mesh_shape, statistics: dict[str, str], copies: int = 1) -> np.ndarray:
    """``value_bytes`` of each entry of ``live`` in ``outputs``' layouts: once per result
    specs, layouts (the rules' shared objects, by identity) and result, as a
    transformer's layers repeat them; a reduction's transient (``Liveness.transient_of``)
    ``copies`` of its raw gradient (``scatter_copies``)."""
    seen: dict[tuple, int] = {}
    sizes = []
    for name, k in live.entries():
        placements = outputs[name]
        if name in statistics:
            sizes.append(value_bytes(graph, name, placements, mesh_shape, statistics, k))
            continue
        key = (graph.node(name).outputs, id(placements), k)   # placements held by outputs
        found = seen.get(key)
        if found is None:
            found = seen[key] = value_bytes(graph, name, placements, mesh_shape, statistics, k)
        sizes.append(found)
    sizes = np.array(sizes, dtype=float)
    for transient, (raw, reduced) in live.transient_of.items():
        sizes[transient] = sizes[raw] * copies if sizes[raw] > sizes[reduced] else 0.0
    for reduced, raw in live.raw_of.items():    # the same storage, or bytes in place
        kept = reduced in live.kept_of and sizes[raw] == sizes[reduced] and \
            partial_sum(outputs[live.names[raw]][live.results[raw] or 0])
        tail, head = live.kept_of.get(reduced, (None, None))
        if tail is not None and head is not None:
            sizes[tail if kept else head] = 0.0
        if sizes[raw] <= sizes[reduced] and not kept:
            sizes[reduced] = 0.0
    return sizes


def partial_sum(placements: Placements) -> bool:
    """Whether a result laid out as ``placements`` is a partial sum over some mesh axis
    (a gradient the plan then reduces)."""
    return any(isinstance(p, Partial) for p in placements)


def scatter_copies(device_type: str) -> int:
    """Copies of a bucket's bytes, beyond its members' raw gradients and reduced blocks,
    that a step of one micro-batch holds where it reduce-scatters them in backward
    (``runtime/rewrites/reduce_in_backward.py``; ``runtime/rewrites/buckets.py``), counted
    at the bucket's packing (``grad_buckets.packing_points``): one on every backend. The
    packed buffer is made beside its members, which die once it is made; on CPU ranks
    gloo then copies the packed buffer as the collective is issued, and the buffer dies
    once copied: the members' raw gradients, held to backward's end, stand for that copy
    (NCCL: for the packed buffer itself). Measured on 2 gloo ranks
    (``tests/end_of_step_worker.py``): an MLP whose 25 MiB bucket packs 12 gradients holds
    the packed buffer, gloo's copy and the output block at once at its issue, which is
    this. Not priced: gloo's thread, busy with the previous bucket's transfer, may copy
    that bucket while the next is packed (a race: one more bucket, seen on the wide MLP's
    buckets of 16.8 MB on some runs and ranks). ``device_type`` is kept for the backends'
    difference, which this does not show."""
    del device_type
    return 1


def same_layout_views(graph: OpGraph, layouts: dict[str, Placements],
                      reads: dict[str, tuple]) -> frozenset[str]:
    """Views of a parameter or buffer (``liveness`` gives them intervals of their own, for
    the copy a read in another layout makes) that read it in its own layout ``layouts``
    (node -> layout; ``reads``: node -> its operands' layouts): a view of the tensor
    itself, which allocates nothing."""
    return frozenset(n.name for n in graph.ops() if n.aliases and n.operands
                     and graph.node(n.operands[0].node).kind in ("param", "buffer")
                     and reads.get(n.name, (None,))[0] == layouts.get(n.operands[0].node))


def activation_timeline(graph: OpGraph, live: Liveness,
                        outputs: dict[str, tuple[Placements, ...]], mesh_shape,
                        statistics: frozenset[str] | dict = frozenset()) -> np.ndarray:
    """Bytes of activations alive at each point of the step on one device."""
    return live.total([value_bytes(graph, name, outputs[name], mesh_shape, statistics, k)
                       for name, k in live.entries()])


def forward_end(graph: OpGraph) -> int:
    """The point where forward ends: what is alive there is what backward will read."""
    return max((i for i, n in enumerate(graph) if n.phase == "forward"), default=0)


@dataclass(frozen=True)
class KeptCopy:
    """A resharded copy of a parameter or buffer that several operand reads share
    (``Reshard.same_as``: ZeRO-2's gathered weight read by forward and by backward): it
    lives from its first reader to its last, holding ``nbytes`` per device."""

    readers: tuple[str, ...]
    nbytes: int
    span: tuple[int, int] | None = None
    """From, to: where no readers name it (a gathered copy a forward view keeps for
    backward, ``gathered_views.held_copies``)."""


def view_copies(graph: OpGraph, outputs: dict[str, tuple], inputs: dict[str, tuple],
                mesh_shape) -> list[KeptCopy]:
    """The gathered copies that forward views keep for backward in a plan whose nodes
    write ``outputs`` and read ``inputs`` (``passes/pricing/gathered_views.py``)."""
    return [KeptCopy((), int(nbytes), (lo, hi)) for lo, hi, nbytes in
            held_copies(graph, saved_view_spans(graph), outputs, inputs, mesh_shape)]


def _kept_timeline(graph: OpGraph, live: Liveness, sizes: np.ndarray,
                   kept: list[KeptCopy], state_at_start: bool) -> np.ndarray:
    """Bytes the kept copies hold at each point. A reader that is a view of the copy
    (its own interval in ``live``: ``liveness`` gives views of state one) shares the
    copy's storage: its interval joins the copy's and its own bytes (``sizes``, set to
    zero here) are not counted twice."""
    order = {n.name: i for i, n in enumerate(graph)}
    position = {name: i for i, name in enumerate(live.names)}     # views: one entry each
    delta = np.zeros(live.length + 1)
    for copy in kept:
        if copy.span is not None:
            delta[copy.span[0]] += copy.nbytes
            delta[copy.span[1] + 1] -= copy.nbytes
            continue
        start = min(order[r] for r in copy.readers)
        end = max(order[r] for r in copy.readers)
        for r in copy.readers:
            if r in position and graph.node(r).aliases:    # a view: the copy is its storage
                i = position[r]
                start, end = min(start, int(live.start[i])), max(end, int(live.end[i]))
                sizes[i] = 0.0
        if state_at_start and any(graph.node(r).phase == "forward" for r in copy.readers):
            start = 0                   # gathered once, before the first micro-batch
        delta[start] += copy.nbytes
        delta[end + 1] -= copy.nbytes
    return np.cumsum(delta)[:-1]


def activation_peak_bytes(graph: OpGraph, outputs: dict[str, tuple[Placements, ...]],
                          mesh_shape, statistics: dict[str, str] | None = None,
                          state_at_start: bool = False,
                          kept: list[KeptCopy] | None = None,
                          grads_from_backward: bool = False,
                          free_views: frozenset[str] = frozenset(),
                          reduce_copies: int = 1,
                          bucket_bytes: float = GRADIENT_BUCKET_BYTES) -> tuple[int, int]:
    """(peak bytes of op results alive at once on one device, bytes alive where forward
    ends: what a micro-batch holds while it waits for backward). Inputs count too, and
    the resharded copies of parameters that several reads share (``kept``), from their
    first reader to their last. ``statistics``: attention forward -> the backward that
    reads what it saved; ``state_at_start``, ``grads_from_backward``: as ``liveness``
    takes them (the gradients alive count with the activations). ``free_views``: views
    of parameters or buffers that read them in their own layout (``same_layout_views``):
    no copy, nothing allocated. ``reduce_copies``: the reduction's copies of a gradient
    reduce-scattered in backward (``scatter_copies``), with ``grads_from_backward``, at its
    bucket's packing (``bucket_bytes``: the runtime's cap, ``grad_buckets``)."""
    statistics = statistics or {}
    live = liveness(graph, statistics, state_at_start, grads_from_backward,
                    bucket_bytes=bucket_bytes)
    sizes = _entry_bytes(graph, live, outputs, mesh_shape, statistics, reduce_copies)
    for i, name in enumerate(live.names):
        if name in free_views:
            sizes[i] = 0.0
    extra = _kept_timeline(graph, live, sizes, kept or [], state_at_start)
    timeline = live.total(sizes) + extra
    if not timeline.size:
        return 0, 0
    return int(timeline.max()), int(timeline[forward_end(graph)])


@dataclass(frozen=True)
class KeptTerm:
    """One possible kept copy at one point, for the ILP's memory row there: the parameter
    or buffer ``producer`` (a representative) stored in a layout its strategies
    ``copy_from`` mark (one from which the target layout needs a collective), read in that
    target layout by both readers of some pair in ``pairs`` (representative, its
    strategies reading the target) whose span covers the point. The copy then holds
    ``nbytes``: ``y >= x_copy_from + x_first + x_second - 2 - x_covered`` for each pair,
    and the row adds ``nbytes * y`` (``passes/sharding/ilp_model.py``). ``covered``: the
    readers that are views alive at the point, with their strategies reading the target:
    a view of the copy is its storage, and the row already counts the view's bytes."""

    producer: str
    copy_from: np.ndarray
    pairs: tuple[tuple[str, np.ndarray, str, np.ndarray], ...]
    nbytes: float
    covered: tuple[tuple[str, np.ndarray], ...] = ()
    key: tuple | None = None
    """Alike at every point but for ``nbytes`` (a view's gathered copy,
    ``MemoryModel.view_terms``): the ILP gives all of a key's terms one ``y``."""

    @property
    def nodes(self) -> set[str]:
        return {self.producer} | {v for a, _, b, _ in self.pairs for v in (a, b)} | \
            {v for v, _ in self.covered}


@dataclass
class _StateReads:
    """The operand reads of one parameter or buffer (``MemoryModel.kept_at``)."""

    name: str
    readers: list[tuple[str, int]]       # (consumer, operand slot)
    spans: list[tuple[int, int]]         # per reader: from, to (a view's own interval)
    views: dict[int, tuple[int, int]]    # reader -> its interval, for readers that are views
    layouts: dict                        # target layout -> readers' strategy masks


class MemoryModel:
    """Per-strategy bytes of every node, folded onto the ILP's representatives.

    ``steps_of(spec, src, dst)`` (``ReshardCosts.steps``), when given, makes the model see
    ZeRO-2's kept copies (``KeptCopy``): a parameter's copy in a layout that needs a
    collective, shared by two or more reads, lives between them. Its existence depends on
    three choices (the parameter's layout and two readers'), so the ILP gets it as
    ``KeptTerm``s (``kept_at``), and ``timeline`` counts the copies a plan keeps."""

    def __init__(self, graph: OpGraph, strategies, grouping, mesh_shape, optimizer_states: int,
                 in_flight: int = 1, statistics: dict[str, str] | None = None,
                 state_at_start: bool = False, steps_of=None,
                 grads_from_backward: bool = False, optimizer: str | None = None,
                 device_type: str = "cpu", bucket_bytes: float = GRADIENT_BUCKET_BYTES):
        self.graph, self.S, self.g, self.mesh_shape = graph, strategies, grouping, mesh_shape
        self.optimizer, self.device_type = optimizer, device_type
        """With an ``optimizer``, the step's end (its optimizer step, ``step_end.py``) is
        one more point, ``end``, after the last of ``live``."""
        self.steps_of = steps_of
        self.state_at_start = state_at_start
        self._state_reads: list[_StateReads] | None = None
        self._copy_from: dict = {}       # (parameter, target layout) -> KeptTerm.copy_from
        self._view_reads_of: dict[int, list] = {}   # view span -> ``_view_reads``
        self.statistics = statistics or {}
        """Attention forward -> the backward that reads the output and statistic it saved."""
        self.optimizer_states = optimizer_states
        self.in_flight = in_flight
        """Micro-batches a device holds at once (a pipeline stage's): one at any point of
        its step, the others waiting for backward with what forward saved."""
        self.grads_from_backward = grads_from_backward
        """Gradients held from their backward op on (``liveness``), not as model state."""
        self._alike_bytes: dict[tuple, np.ndarray] = {}
        self._kept_alive: list = []
        self.bucket_bytes = bucket_bytes
        self.live = liveness(graph, self.statistics, state_at_start, grads_from_backward,
                             bucket_bytes=bucket_bytes)
        """``bucket_bytes``: the runtime's gradient bucket cap (``grad_buckets``): where
        each reduction's transient copy is counted."""
        self.view_spans = saved_view_spans(graph)
        """Forward views that backward reads: a gathered copy one reads is kept
        (``gathered_views``; ``view_terms``)."""
        self.forward_end = forward_end(graph)
        reps = grouping.representatives
        self.state = {r: np.zeros(len(strategies[r])) for r in reps}
        raw = summed_gradients(graph, optimizer_states, grads_from_backward)
        for n in graph:
            copies = state_copies(graph, n.name, optimizer_states,
                                  grads_from_backward or n.name in raw)
            if copies:
                self._fold(self.state, n.name, self._bytes(n.name) * copies)
        for ref in raw.values():    # the sum over micro-batches, as its op lays it out
            self._fold(self.state, ref.node, self._bytes(ref.node, ref.index))
        self.reduce_copies = scatter_copies(device_type)
        self._act = [self._bytes(name, k) for name, k in self.live.entries()]
        for transient in self.live.transient_of:
            self._act[transient] = self._act[transient] * self.reduce_copies
        self._paired: dict[int, list[tuple]] | None = None
        self.end = self.live.length
        self.end_rows = self._end_rows() if optimizer is not None else []
        """The rows at ``end`` (``_end_rows``): the point is at most their largest."""

    def _end_rows(self) -> list[dict[str, np.ndarray]]:
        """The ILP's rows at the optimizer step (``step_end.StepEnd``, which the estimate
        reads too), bytes per representative strategy: each leaf's copies in its layout,
        and the update's temporaries as the runtime allocates them. With ``foreach``: a
        term per trained parameter, one row. Tensor by tensor: the largest local block's
        copies, a maximum over the parameters, which is one row per trained parameter
        (the row of the largest is the one that binds): exact. Where only the local
        blocks' sizes decide between the two (``StepEnd.foreach`` None: a CPU group too
        large whole for ``foreach``), the ILP cannot know which runs before it chooses
        the layouts: the rows hold both, the ``foreach`` one with its temporaries at
        their most (``StepEnd.foreach_cap``), a safe bound above the estimate's. Where the
        step sums micro-batches, the point also holds the sums' reduction before the update
        (``sum_reduction``): ``_reduction_rows``; where it gathers its parameters once,
        before its first micro-batch (``state_at_start``), that gather, which holds the
        same leaves with no activations (``state_gather``): ``_gather_rows``."""
        assert self.optimizer is not None
        end = step_end(self.graph, self.optimizer, self.optimizer_states, self.device_type)
        if end is None:
            return [{}]
        return self._update_rows(end) + self._reduction_rows() + self._gather_rows()

    def _gather_rows(self) -> list[dict[str, np.ndarray]]:
        """Rows where a step of several micro-batches gathers its parameters before the
        first (``state_gather``): the leaves' copies, and one row more per bucket with the
        gathered copies of the buckets before it and its own gather's bytes (each
        member's read bytes beyond its block, times ``spread`` and the bucket's
        ``factor``). A member's gatherer is its first forward reader any of whose
        strategies reads its data; where some of that reader's strategies read it for its
        shape only, they count no read (the estimate: nothing gathered)."""
        if not self.state_at_start:
            return []
        found = state_gather(self.graph, self.optimizer_states, int(np.prod(self.mesh_shape)),
                             self.device_type, self.bucket_bytes)
        if found is None:
            return []
        base: dict[str, np.ndarray] = {}
        for name, copies in found.copies.items():
            self._fold(base, name, self._bytes(name) * copies)
        rows = [base]
        held: dict[str, np.ndarray] = {}
        for bucket in found.buckets:
            row = {k: v.copy() for k, v in base.items()}
            gathered: dict[str, np.ndarray] = {}
            for leaf in bucket:
                read = self._read_bytes(leaf, found.reads[leaf])
                if read is None:
                    continue
                reader, vec = read
                self._fold(gathered, reader, vec * found.spread)
                self._fold(gathered, leaf, -self._bytes(leaf) * found.spread)
            for k, v in held.items():
                row[k] = row.get(k, 0.0) + v
            for k, v in gathered.items():
                row[k] = row.get(k, 0.0) + v * found.factor(bucket)
                held[k] = held.get(k, 0.0) + v
            rows.append(row)
        return rows

    def _read_bytes(self, leaf: str, readers) -> tuple[str, np.ndarray] | None:
        """(reader, bytes per its strategy) of ``leaf``'s first read in ``readers`` any of
        whose strategies takes the leaf's data (a layout; None: its shape only, 0 bytes);
        None where none does."""
        spec = self.graph.node(leaf).output
        for reader, slot in readers:
            layouts = [s.inputs[slot] for s in self.S[reader]]
            if all(p is None for p in layouts):
                continue
            return reader, np.array([0.0 if p is None else float(
                local_bytes(spec, p, self.mesh_shape)) for p in layouts])
        return None

    def _reduction_rows(self) -> list[dict[str, np.ndarray]]:
        """Rows where a step that sums micro-batches reduces the sums (``sum_reduction``):
        the leaves' copies and the sums, and one row more per bucket with its packing
        (each member's sum beyond its block, times ``spread``); the point is the largest."""
        if self.grads_from_backward:
            return []
        found = sum_reduction(self.graph, self.optimizer_states, int(np.prod(self.mesh_shape)),
                              self.bucket_bytes)
        if found is None:
            return []
        base: dict[str, np.ndarray] = {}
        for name, copies in found.copies.items():
            self._fold(base, name, self._bytes(name) * copies)
        for ref in found.sums.values():
            self._fold(base, ref.node, self._bytes(ref.node, ref.index))
        rows = [base]
        for bucket in found.buckets:
            row = {k: v.copy() for k, v in base.items()}
            for param in bucket:
                ref = found.sums[param]
                self._fold(row, ref.node, self._bytes(ref.node, ref.index) * found.spread)
                self._fold(row, param, -self._bytes(param) * found.spread)
            rows.append(row)
        return rows

    def _update_rows(self, end) -> list[dict[str, np.ndarray]]:
        """``_end_rows`` at the update itself (``step_end.StepEnd`` ``end``)."""
        base: dict[str, np.ndarray] = {}
        for name, copies in end.copies.items():
            self._fold(base, name, self._bytes(name) * copies)
        if end.foreach is False:
            return [base]
        if end.foreach:
            row = {k: v.copy() for k, v in base.items()}
            for name in end.trained:
                self._fold(row, name, self._bytes(name) * end.per_block)
            return [row]
        rows: dict[tuple, dict[str, np.ndarray]] = {}
        for name in end.trained:      # alike parameters give one row
            key = (self.g.rep[name], self._bytes(name)[list(self.g.index[name])].tobytes())
            if key not in rows:
                row = {k: v.copy() for k, v in base.items()}
                self._fold(row, name, self._bytes(name) * end.per_largest)
                rows[key] = row
        itemsize = {name: self.graph.node(name).output.itemsize for name in end.trained}
        capped = {k: v.copy() for k, v in base.items()}
        first = next(iter(capped), None)
        if first is not None:
            capped[first] = capped[first] + end.foreach_cap(itemsize)
        return list(rows.values()) + [capped]

    def _bytes(self, name: str, result: int | None = None) -> np.ndarray:
        strategies = self.S[name]
        # nodes alike (a transformer's layers: the same result specs and the rules'
        # shared strategies) hold the same bytes; an attention saving its statistic is
        # priced on its own
        key = None if name in self.statistics else \
            (tuple(map(id, strategies)), self.graph.node(name).outputs, result)
        found = self._alike_bytes.get(key) if key is not None else None
        if found is None:
            found = np.array([value_bytes(self.graph, name, s.outputs, self.mesh_shape,
                                          self.statistics, result) for s in strategies],
                             dtype=float)
            found.setflags(write=False)
            if key is not None:     # the strategies kept: their identities stay theirs
                self._alike_bytes[key] = found
                self._kept_alive.append(strategies)
        return found

    def _fold(self, into: dict, name: str, vec: np.ndarray) -> None:
        rep = self.g.rep[name]
        into[rep] = into.get(rep, np.zeros(len(self.S[rep]))) + vec[list(self.g.index[name])]

    def rows_at(self, t: int) -> list[dict[str, np.ndarray]]:
        """The ILP's memory rows at point ``t``: ``terms_at``, or at ``end`` one or more
        (``end_rows``), each a bound the point's bytes must meet."""
        if t == self.end:
            return [{k: v.copy() for k, v in row.items() if v.any()} for row in self.end_rows]
        return [self.terms_at(t)]

    def terms_at(self, t: int) -> dict[str, np.ndarray]:
        """Bytes alive at point ``t`` (not ``end``: ``rows_at``) for each representative
        strategy."""
        assert t != self.end, "the optimizer step has rows of its own: rows_at"
        terms = {k: v.copy() for k, v in self.state.items() if v.any()}
        paired = self.paired_entries()
        for i in self.live.alive(t):
            if i not in paired:
                self._fold(terms, self.live.names[i], self._act[i])
        if self.in_flight > 1:
            for i in self.live.alive(self.forward_end):
                if i not in paired:
                    self._fold(terms, self.live.names[i], self._act[i] * (self.in_flight - 1))
        return terms

    def rows_bytes(self, t: int, chosen: dict) -> list[float]:
        """Bytes each of the ILP's rows at point ``t`` (``rows_at``, ``kept_at``) counts
        for the plan ``chosen`` (node -> Strategy): what the solver sees of that plan."""
        def picked(rep: str) -> int:
            return next(b for b, a in enumerate(self.g.index[rep])
                        if self.S[rep][a] is chosen[rep])

        def marked(rep: str, mask) -> bool:
            return bool(mask[picked(rep)])

        kept = sum(term.nbytes for term in self.kept_at(t)
                   if marked(term.producer, term.copy_from)
                   and any(marked(a, ma) and marked(b, mb) for a, ma, b, mb in term.pairs)
                   and not any(marked(v, mv) for v, mv in term.covered))
        return [float(sum(vec[picked(rep)] for rep, vec in row.items()) + kept)
                for row in self.rows_at(t)]

    def paired_entries(self) -> dict[int, list[tuple]]:
        """Entries of ``live`` whose bytes depend on two nodes' choices, as the plan's
        estimate counts them (``activation_peak_bytes``; ``_entry_bytes``), each ->
        (producer, its strategies' mask, reader, its strategies' mask, bytes): the entry
        holds ``bytes`` where both choose a marked strategy, else nothing. The ILP gets
        them as ``KeptTerm``s (``paired_terms``), exact where ``terms_at`` would count
        the bytes whatever the other node chose:

        - a view of a parameter or buffer (``liveness`` gives it an interval of its own,
          for the copy a read in another layout makes) holds its bytes only where it
          reads the leaf in a layout other than the leaf's own (``same_layout_views``);
        - a parameter's reduced gradient (``Liveness.raw_of``) holds bytes of its own
          only where its raw gradient is larger (a reduce-scatter shrinks it), else the
          two are one storage, counted with the raw one; and only there the reduction
          makes its transient copies (``Liveness.transient_of``)."""
        if self._paired is not None:
            return self._paired
        graph, live, g = self.graph, self.live, self.g
        paired: dict[int, list[tuple]] = {}
        for i, name in enumerate(live.names):
            leaf = viewed_leaf(graph, name)
            if leaf is None:
                continue
            own = [self.S[leaf][a].outputs[0] for a in g.index[leaf]]
            reads = [self.S[name][b].inputs[0] for b in g.index[name]]
            sizes = self._act[i][list(g.index[name])]
            paired[i] = []
            for dst in dict.fromkeys(reads):
                copy_from = np.array([o != dst for o in own], dtype=bool)
                read = np.array([r == dst for r in reads], dtype=bool)
                for size in np.unique(sizes[read]) if copy_from.any() else ():
                    if size > 0:
                        paired[i].append((leaf, copy_from, name, read & (sizes == size),
                                          float(size)))
        for reduced, raw in live.raw_of.items():
            param, made = live.names[reduced], live.names[raw]
            held = self._act[reduced][list(g.index[param])]
            raw_sizes = self._act[raw][list(g.index[made])]
            paired[reduced] = [(param, held == size, made, raw_sizes > size, float(size))
                               for size in np.unique(held) if size > 0
                               and (raw_sizes > size).any()]
            if reduced in live.kept_of:
                self._pair_kept(paired, reduced, raw, held, raw_sizes)
        for transient, (raw, reduced) in live.transient_of.items():
            param, made = live.names[reduced], live.names[raw]
            held = self._act[reduced][list(g.index[param])]
            raw_sizes = self._act[raw][list(g.index[made])]
            paired[transient] = [(param, held == size, made, raw_sizes == whole,
                                  float(whole) * self.reduce_copies)
                                 for size in np.unique(held) for whole in np.unique(raw_sizes)
                                 if whole > size]
        self._paired = paired
        return paired

    def _pair_kept(self, paired: dict[int, list[tuple]], reduced: int, raw: int,
                   held: np.ndarray, raw_sizes: np.ndarray) -> None:
        """``paired_entries`` of a gradient in a bucket of two or more
        (``Liveness.kept_of``): where its raw gradient is a partial sum of its reduced
        one's size (an all-reduce into a kept buffer), the reduced gradient is held, from
        the step's start (the head), and the raw one not after the packing (the tail)."""
        live, g = self.live, self.g
        param, made = live.names[reduced], live.names[raw]
        k = live.results[raw] or 0
        partial = np.array([partial_sum(self.S[made][a].outputs[k]) for a in g.index[made]],
                           dtype=bool)
        tail, head = live.kept_of[reduced]
        paired[reduced] += [(param, held == size, made, partial & (raw_sizes == size),
                             float(size)) for size in np.unique(held) if size > 0
                            and (partial & (raw_sizes == size)).any()]
        paired[head] = [(param, held == size, made, partial & (raw_sizes == size), float(size))
                         for size in np.unique(held) if size > 0
                         and (partial & (raw_sizes == size)).any()]
        paired[tail] = [(param, held == size, made, (raw_sizes == whole) &
                         ~(partial & (whole == size)), float(whole))
                        for size in np.unique(held) for whole in np.unique(raw_sizes)
                        if whole > 0 and ((raw_sizes == whole) & ~(partial & (whole == size))).any()]

    def paired_terms(self, t: int) -> list[KeptTerm]:
        """``paired_entries`` alive at point ``t`` (and, for the other micro-batches in
        flight, where forward ends) as ``KeptTerm``s, ``y >= x_producer + 2 x_reader - 2``:
        alike entries (the same nodes' representatives and masks) summed into one term,
        whose ``y`` every point shares."""
        fe, waiting = self.forward_end, self.in_flight - 1
        start, end = self.live.start, self.live.end
        merged: dict[tuple, list] = {}
        for i, pairs in self.paired_entries().items():
            count = int(start[i] <= t <= end[i]) + waiting * int(start[i] <= fe <= end[i])
            if not count:
                continue
            for producer, copy_from, reader, mask, nbytes in pairs:
                key = ("paired", self.g.rep[producer], copy_from.tobytes(), self.g.rep[reader],
                       mask.tobytes())
                found = merged.setdefault(key, [copy_from, mask, 0.0])
                found[2] += nbytes * count
        return [KeptTerm(key[1], copy_from, ((key[3], mask, key[3], mask),), nbytes, key=key)
                for key, (copy_from, mask, nbytes) in merged.items()]

    def timeline(self, chosen_outputs: dict, state_bytes: float,
                 kept: list[KeptCopy] | None = None,
                 free_views: frozenset[str] = frozenset(),
                 chosen_inputs: dict | None = None) -> np.ndarray:
        """Bytes at each point: model states, activations (with the other micro-batches'
        saved ones) and the ``kept`` copies (``kept_copies``; a view reading one shares
        its storage), as ``activation_peak_bytes`` counts them (``free_views``: views of
        leaves read in their own layout, nothing allocated). ``chosen_inputs`` (node ->
        the layouts it reads its operands in): for the parameters' gather before the
        first micro-batch (``state_gather``), priced at ``end`` where given."""
        graph, live = self.graph, self.live
        sizes = _entry_bytes(graph, live, chosen_outputs, self.mesh_shape, self.statistics,
                             self.reduce_copies)
        for i, name in enumerate(live.names):
            if name in free_views:
                sizes[i] = 0.0
        kept = kept or []
        views = _kept_timeline(graph, live, sizes, [c for c in kept if c.span is not None],
                               self.state_at_start)     # one per micro-batch in flight
        extra = _kept_timeline(graph, live, sizes, [c for c in kept if c.span is None],
                               self.state_at_start)
        timeline = self._with_waiting(live.total(sizes) + views) + extra + state_bytes
        if self.optimizer is None:
            return timeline
        leaves = {n.name: chosen_outputs[n.name][0] for n in graph
                  if n.kind in ("param", "buffer")}
        end = end_of_step_bytes(graph, leaves, self.mesh_shape, self.optimizer,
                                self.optimizer_states, self.device_type)
        if not self.grads_from_backward:
            end = max(end, sum_reduction_bytes(graph, leaves, chosen_outputs, self.mesh_shape,
                                               self.optimizer_states, self.bucket_bytes))
        if self.state_at_start and chosen_inputs is not None:
            end = max(end, state_gather_bytes(graph, leaves, chosen_inputs, self.mesh_shape,
                                              self.optimizer_states, self.device_type,
                                              self.bucket_bytes))
        return np.append(timeline, end)

    def kept_copies(self, chosen: dict) -> list[KeptCopy]:
        """The copies ``chosen`` (node -> Strategy) keeps, as the plan's ``Reshard.same_as``
        makes them (``sharding_plan.kept_state_copies``): reads of a parameter or buffer in
        one layout that needs a collective, two or more; and the gathered copies forward
        views keep for backward (``view_copies``)."""
        kept = [KeptCopy((), int(nbytes), (lo, hi)) for lo, hi, nbytes in held_copies(
            self.graph, self.view_spans, {k: s.outputs for k, s in chosen.items()},
            {k: s.inputs for k, s in chosen.items()}, self.mesh_shape)]
        if self.steps_of is None:
            return kept
        for value in self.state_reads():
            node = self.graph.node(value.name)
            src = chosen[value.name].outputs[0]
            by_layout: dict = {}
            for consumer, slot in value.readers:
                dst = chosen[consumer].inputs[slot]
                by_layout.setdefault(dst, []).append(consumer)
            for dst, names in by_layout.items():
                if len(names) > 1 and dst is not None and \
                        _collective(self.steps_of(node.output, src, dst)):
                    kept.append(KeptCopy(tuple(names), local_bytes(node.output, dst,
                                                                   self.mesh_shape)))
        return kept

    def state_reads(self) -> list[_StateReads]:
        """Parameters and buffers two or more operand reads take, with those reads."""
        if self._state_reads is not None:
            return self._state_reads
        graph, live = self.graph, self.live
        order = {n.name: i for i, n in enumerate(graph)}
        position = {name: i for i, name in enumerate(live.names)}
        reads: dict[str, list[tuple[str, int]]] = {}
        for node in graph.ops():
            for slot, ref in enumerate(node.operands):
                if graph.node(ref.node).kind in ("param", "buffer"):
                    reads.setdefault(ref.node, []).append((node.name, slot))
        out = []
        for name, readers in reads.items():
            if len(readers) < 2:
                continue
            spans, views = [], {}
            for k, (consumer, _) in enumerate(readers):
                lo = hi = order[consumer]
                if consumer in position and graph.node(consumer).aliases:
                    i = position[consumer]
                    views[k] = (int(live.start[i]), int(live.end[i]))
                    lo, hi = min(lo, views[k][0]), max(hi, views[k][1])
                if self.state_at_start and graph.node(consumer).phase == "forward":
                    lo = 0
                spans.append((lo, hi))
            layouts: dict = {}
            for k, (consumer, slot) in enumerate(readers):
                rep, index = self.g.rep[consumer], self.g.index[consumer]
                for b, a in enumerate(index):
                    dst = self.S[consumer][a].inputs[slot]
                    if dst is not None:
                        masks = layouts.setdefault(dst, {})
                        masks.setdefault(k, (rep, np.zeros(len(index), dtype=bool)))[1][b] = True
            out.append(_StateReads(name, readers, spans, views, layouts))
        self._state_reads = out
        return out

    def kept_at(self, t: int) -> list[KeptTerm]:
        """The kept copies that may be alive at point ``t``, one term per parameter and
        target layout (empty without ``steps_of``), and those of gathered copies forward
        views keep (``view_terms``); none at ``end``."""
        if t == self.end:
            return []
        terms = self.view_terms(t) + self.paired_terms(t)
        if self.steps_of is None:
            return terms
        for value in self.state_reads():
            node = self.graph.node(value.name)
            index = list(self.g.index[value.name])
            sources = [self.S[value.name][a].outputs[0] for a in index]
            covering = [(i, j) for i in range(len(value.readers))
                        for j in range(i + 1, len(value.readers))
                        if min(value.spans[i][0], value.spans[j][0]) <= t <=
                        max(value.spans[i][1], value.spans[j][1])]
            if not covering:
                continue
            for dst, masks in value.layouts.items():
                pairs = tuple((*masks[i], *masks[j]) for i, j in covering
                              if i in masks and j in masks)
                key = (value.name, dst)
                if key not in self._copy_from:
                    self._copy_from[key] = np.array(
                        [_collective(self.steps_of(node.output, src, dst)) for src in sources],
                        dtype=bool)
                copy_from = self._copy_from[key]
                if pairs and copy_from.any():
                    covered = tuple(masks[k] for k, (lo, hi) in value.views.items()
                                    if k in masks and lo <= t <= hi)
                    terms.append(KeptTerm(self.g.rep[value.name], copy_from, pairs,
                                          float(local_bytes(node.output, dst,
                                                            self.mesh_shape)), covered))
        return terms

    def view_terms(self, t: int) -> list[KeptTerm]:
        """The gathered copies forward views may keep at point ``t`` (``gathered_views``),
        with those of the other micro-batches in flight where forward ends, as
        ``KeptTerm``s: one per producer's representative, its strategies writing one size
        of the operand, the view's representative and its strategies reading one larger
        layout (``y >= x_copy_from + 2 x_view - 2``), alike views' bytes summed."""
        fe, waiting = self.forward_end, self.in_flight - 1
        merged: dict[tuple, list] = {}
        for n, span in enumerate(self.view_spans):
            if not (span.start <= t <= span.end or waiting and span.start <= fe <= span.end):
                continue
            for key, whole, copy_from, mask, size in self._view_reads(n):
                nbytes = copy_bytes(span, t, size, whole) + \
                    waiting * copy_bytes(span, fe, size, whole)
                if nbytes:
                    found = merged.setdefault(key, [copy_from, mask, 0.0])
                    found[2] += nbytes
        return [KeptTerm(key[0], copy_from, ((key[2], mask, key[2], mask),), nbytes,
                         key=("view",) + key)
                for key, (copy_from, mask, nbytes) in merged.items()]

    def _view_reads(self, n: int) -> list[tuple[tuple, float, np.ndarray, np.ndarray, float]]:
        """What ``view_terms`` reads of view span ``n`` at every point, made once per span:
        (term key, the target layout's bytes, the producer's strategies writing ``size``
        bytes that can reshard to it, the view's strategies reading it, ``size``), per
        target layout and smaller size in ``view_terms``' order. Only the bytes at a point
        depend on it: a stage ILP asks for 8-9 points, and pricing every strategy's
        layouts again at each was a third of the CPU of GPT-39B's two-layer stage solves
        (``benchmarks/stage_solve_ab.py``)."""
        found = self._view_reads_of.get(n)
        if found is not None:
            return found
        span = self.view_spans[n]
        u, v, spec = span.operand.node, span.view, self.graph.spec(span.operand)
        src = np.array([local_bytes(spec, self.S[u][a].outputs[span.operand.index],
                                    self.mesh_shape) for a in self.g.index[u]], dtype=float)
        reads = [self.S[v][b].inputs[0] for b in self.g.index[v]]
        found = []
        for dst in dict.fromkeys(d for d in reads if d is not None):
            whole = float(local_bytes(spec, dst, self.mesh_shape))
            mask = np.array([d == dst for d in reads], dtype=bool)
            grows = src < whole
            if self.steps_of is not None:       # only where the read can reshard
                grows &= [self.steps_of(spec, self.S[u][a].outputs[span.operand.index],
                                        dst) is not None for a in self.g.index[u]]
            for size in np.unique(src[grows]):
                copy_from = grows & (src == size)
                found.append(((self.g.rep[u], copy_from.tobytes(), self.g.rep[v],
                               mask.tobytes()), whole, copy_from, mask, size))
        self._view_reads_of[n] = found
        return found

    def _kept_upper(self) -> np.ndarray:
        """Bytes kept copies could hold at each point: per parameter, its largest read
        layout once per two readers, over the span of all its reads."""
        delta = np.zeros(self.live.length + 1)
        if self.steps_of is None:
            return delta[:-1]
        for value in self.state_reads():
            spec = self.graph.node(value.name).output
            most = max(local_bytes(spec, dst, self.mesh_shape) for dst in value.layouts) \
                if value.layouts else 0
            lo = min(s[0] for s in value.spans)
            hi = max(s[1] for s in value.spans)
            delta[lo] += most * (len(value.readers) // 2)
            delta[hi + 1] -= most * (len(value.readers) // 2)
        return np.cumsum(delta)[:-1]

    def _with_waiting(self, act: np.ndarray) -> np.ndarray:
        """Add the saved activations of the other micro-batches in flight."""
        if self.in_flight > 1 and act.size:
            act = act + (self.in_flight - 1) * act[self.forward_end]
        return act

    def upper_timeline(self) -> np.ndarray:
        """Bytes at each point if every value took its largest layout: memory can only be
        over the budget where this is."""
        state = sum(v.max() for v in self.state.values())
        timeline = state + self._with_waiting(self._timeline(np.max) + self._views_upper()) + \
            self._kept_upper()
        if self.optimizer is None:
            return timeline
        return np.append(timeline, max(sum(v.max() for v in row.values()) for row in self.end_rows))

    def lower_timeline(self) -> np.ndarray:
        """Bytes at each point but ``end`` that every plan holds at least, whatever its
        layouts: ``timeline``'s count with each term at its least. Model states: each
        representative's smallest bytes (its nodes decide together, so this is a floor for
        plans of this grouping and of every coarser one). Activations: each entry's
        smallest layout, its node alone; nothing for an entry ``timeline`` may count as
        nothing (a view of a parameter read in its own layout, a reduction's transient, a
        reduced gradient sharing its raw one's storage, either part of a kept bucket), and
        for the kept copies it adds. ``timeline`` is a sum of these terms with the other
        micro-batches' saved bytes taken where forward ends, each at least as large for
        any plan, so at every point it is at least this; a point over the budget here is
        over it in every plan."""
        state = sum(float(v.min()) for v in self.state.values())
        live = self.live
        freed = set(live.transient_of) | set(live.raw_of) | \
            {i for pair in live.kept_of.values() for i in pair}
        leaf_views = {n.name for n in self.graph.ops() if n.aliases and n.operands
                      and self.graph.node(n.operands[0].node).kind in ("param", "buffer")}
        least = [0.0 if i in freed or name in leaf_views else float(vec.min())
                 for i, (name, vec) in enumerate(zip(live.names, self._act))]
        return state + self._with_waiting(live.total(least))

    def _views_upper(self) -> np.ndarray:
        """Bytes the gathered copies forward views keep could hold at each point: each
        view's largest read layout over its span."""
        delta = np.zeros(self.live.length + 1)
        for span in self.view_spans:
            spec = self.graph.spec(span.operand)
            most = max((local_bytes(spec, s.inputs[0], self.mesh_shape)
                        for s in self.S[span.view] if s.inputs[0] is not None), default=0)
            delta[span.start] += most
            delta[span.end + 1] -= most
        return np.cumsum(delta)[:-1]

    def _timeline(self, pick) -> np.ndarray:
        """Activation bytes at each point with each value's layout chosen by ``pick``."""
        # nodes alike hold one array of bytes (``_bytes``): each picked once
        picked: dict[int, float] = {}
        values = []
        for vec in self._act:
            found = picked.get(id(vec))
            if found is None:
                found = picked[id(vec)] = pick(vec)
            values.append(found)
        return self.live.total(values)

    def likely_peaks(self) -> list[int]:
        """Points where activations peak if every value takes its largest / smallest layout."""
        return sorted({int(np.argmax(self._timeline(pick))) for pick in (np.max, np.min)})


def _collective(steps) -> bool:
    """Whether resharding ``steps`` (None: impossible) communicate: a copy worth sharing."""
    return bool(steps) and any(s.is_collective for s in steps)


def in_flight_bytes(state: float, peak: float, saved: float, in_flight: int) -> float:
    """Bytes of a device holding ``in_flight`` micro-batches: model states, one
    micro-batch at its activation peak and the others with what their forward saved."""
    return state + peak + (in_flight - 1) * saved
