"""The ILP's cost graph: cost vectors on representative nodes, matrices on their edges.

Every op node costs its compute and the all-reduces it runs inside itself: those of its
statistics, for a strategy that splits a synced dim (a phased softmax), or the sum
all-reduces of a batch-synced op (batch norm over a split batch); every edge costs the
resharding between the layout the producer writes and the layout the consumer reads; each
parameter's gradient pays to reach its parameter's layout; the loss pays to become whole
on every device. Costs of nodes that follow a representative (``passes/sharding/simplify.py``) fold
onto it, so the ILP only sees representatives. Repeated layers produce the same edge many
times: each distinct edge is priced once and multiplied.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import numpy as np

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import OpGraph, TensorSpec
from torchalpa.core.placement import Partial, Placements, replicated
from torchalpa.passes.pricing.cost import (
    batch_sync_cost,
    compute_cost,
    gradient_steps_cost,
    op_family,
    steps_cost,
    strategy_bytes,
)
from torchalpa.passes.sharding.ilp import Edge
from torchalpa.passes.sharding.reshard import local_bytes, plan_reshard
from torchalpa.passes.sharding.shared_reshard import (
    SHARING_ROUNDS,
    SharedReads,
    duplicated_reads,
    shared_groups,
)
from torchalpa.passes.sharding.simplify import Grouping
from torchalpa.passes.sharding.stage_boundary import boundary_layout
from torchalpa.passes.sharding.strategies import Strategy, sync_steps

__all__ = ["ReshardCosts", "CostGraph", "build_cost_graph", "saved_views", "op_compute_seconds",
           "solve_sharing_reads", "SLICE_PARTIAL", "RESLICE_REDUCTION",
           "REGATHER_SAVED_VIEWS"]

# Local steps ``ReshardCosts.forbidden`` may name besides collective kinds (both without
# ``AutoShardingOption.slice_before_reduce``, Alpa's space):
SLICE_PARTIAL = "slice_partial"
"""A slice of a partial sum: the sum is then all-reduced at the size of the slice."""
RESLICE_REDUCTION = "reslice_reduction"
"""An operand read of a reduction (``REDUCTIONS``) by local slices alone: the sum over a
part of a whole value. Alpa's reductions read the layout their operand is made in."""
REGATHER_SAVED_VIEWS = "regather_saved_views"
"""No forward view that backward reads may gather its operand (``_forbid_gathers``):
Megatron's sequence parallelism, asked for, gathers again in backward. Otherwise the
copy such a view keeps is priced (``passes/pricing/gathered_views.py``)."""
REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "prod", "var", "std", "logsumexp"})

log = logging.getLogger("torchalpa.planner")

STEPS_MEMO_MAX = 200_000
"""Entries ``ReshardCosts.steps`` keeps by identity before it starts again."""


class ReshardCosts:
    """Memoized resharding steps and their alpha-beta cost on one mesh."""

    def __init__(self, mesh: LogicalMesh, allow_reduce_scatter: bool = True,
                 forbidden: frozenset = frozenset()):
        self.mesh = mesh
        self.allow_reduce_scatter = allow_reduce_scatter
        self.forbidden = frozenset(forbidden)   # collective kinds resharding may not use
        self._cost: dict = {}
        # tensors and layouts as small ints, and edge tables by them: an edge's table is
        # looked up by one tuple of ints instead of a (spec, layout, layout) key per cell,
        # whose hashing (placements hash in Python) was most of building a cost graph
        self._ids: dict = {}
        self._tables: dict[tuple, np.ndarray] = {}
        self._cells: dict[tuple, float] = {}      # (bytes, layout ints, gradient) -> cost
        # (spec, src, dst) by identity -> (them, the steps): the plans and the ILPs' rounds
        # ask for the same objects' steps again and again (the rules' shared layouts, a
        # graph's specs); kept with the answer so their identities stay theirs
        self._steps: dict[tuple[int, int, int], tuple] = {}
        self._steps_alike: dict[tuple, tuple] = {}     # (spec, src, dst) -> (the steps,)
        self._by_object: dict[int, tuple] = {}   # id(layout) -> (it, its ``_id``): ``_distinct``

    def steps(self, spec: TensorSpec, src: Placements, dst: Placements | None):
        """The resharding steps, or None if impossible or if they need a forbidden kind
        of collective on an axis with more than one device."""
        if dst is None:
            return ()
        key = (id(spec), id(src), id(dst))
        found = self._steps.get(key)
        if found is not None and found[0] is spec and found[1] is src and found[2] is dst:
            return found[3]
        # the same value of another layer (its own spec and layout objects, equal):
        # the steps read nothing of a spec but its value
        alike = (spec, src, dst)
        planned = self._steps_alike.get(alike)     # (the steps,): None is an answer too
        if planned is None:
            planned = self._steps_alike[alike] = (self._plan_steps(spec, src, dst),)
        steps = planned[0]
        if len(self._steps) >= STEPS_MEMO_MAX:
            self._steps.clear()
            self._steps_alike.clear()
        self._steps[key] = (spec, src, dst, steps)
        return steps

    def _plan_steps(self, spec: TensorSpec, src: Placements, dst: Placements):
        steps = plan_reshard(spec, src, dst, self.mesh.shape, self.allow_reduce_scatter,
                             "all_to_all" not in self.forbidden)
        if steps and self.forbidden and any(
                (s.kind in self.forbidden or SLICE_PARTIAL in self.forbidden and s.kind == "slice"
                 and any(isinstance(p, Partial) for p in s.src))
                and self.mesh.shape[s.axis] > 1 for s in steps):
            return None
        return steps

    def reslices(self, spec: TensorSpec, src: Placements, dst: Placements | None) -> bool:
        """Whether reading ``src`` as ``dst`` takes local slices and nothing else."""
        steps = self.steps(spec, src, dst)
        return bool(steps) and all(s.kind == "slice" for s in steps)

    def cost(self, spec: TensorSpec, src: Placements, dst: Placements | None,
             gradient: bool = False) -> float:
        """Seconds to reshard; ``gradient``: a gradient's final resharding, whose reduction
        the runtime buckets (``gradient_steps_cost``)."""
        key = (spec.nbytes, src, dst, gradient)    # steps read the bytes alone of spec
        c = self._cost.get(key)
        if c is None:
            steps = self.steps(spec, src, dst)
            price = gradient_steps_cost if gradient else steps_cost
            c = math.inf if steps is None else price(self.mesh, steps)
            self._cost[key] = c
        return c

    def edge(self, u: str, v: str, spec: TensorSpec, rows: list, cols: list,
             gradient: bool = False) -> Edge:
        """An ILP edge: the cost table over the distinct layouts on each side (tensors of
        as many bytes share it: ``plan_reshard``'s steps read nothing else of a spec)."""
        urows, ri, row_ids = self._distinct(rows)
        ucols, ci, col_ids = self._distinct(cols)
        nbytes = spec.nbytes
        key = (nbytes, row_ids, col_ids, gradient)
        table = self._tables.get(key)
        if table is None:
            # each cell by the layouts' ints (equal layouts, equal ints: ``cost``'s key
            # without hashing placements again)
            cells = self._cells
            table = np.empty((len(urows), len(ucols)))
            for i, (r, a) in enumerate(zip(urows, row_ids)):
                for j, (c, b) in enumerate(zip(ucols, col_ids)):
                    cell = (nbytes, a, b, gradient)
                    found = cells.get(cell)
                    if found is None:
                        found = cells[cell] = self.cost(spec, r, c, gradient)
                    table[i, j] = found
            self._tables[key] = table
        return Edge(u, v, ri, ci, table.copy())

    def _id(self, item) -> int:
        """A small int standing for a layout in this object's keys."""
        found = self._ids.get(item)
        if found is None:
            found = self._ids[item] = len(self._ids)
        return found

    def _distinct(self, items: list) -> tuple[list, np.ndarray, tuple[int, ...]]:
        """``_unique(items)`` and the distinct items' ``_id``s. Layouts repeat as the same
        objects (the rules' shared strategies): an object's int is kept by identity, so a
        layout is hashed (placements hash in Python) the first time this object meets it
        and never again, where ``_unique`` and ``_id`` hashed it once each per edge."""
        known = self._by_object
        if len(known) >= STEPS_MEMO_MAX:
            known.clear()
        position: dict[int, int] = {}     # an item's id -> its position among the distinct
        by_layout: dict[int, int] = {}    # a layout's int -> its position
        first: list = []
        idx = []
        for x in items:
            i = position.get(id(x))
            if i is None:
                found = known.get(id(x))
                if found is None or found[0] is not x:
                    found = known[id(x)] = (x, self._id(x))   # the object held: its id stays
                i = by_layout.get(found[1])
                if i is None:
                    i = by_layout[found[1]] = len(first)
                    first.append(x)
                position[id(x)] = i
            idx.append(i)
        return first, np.array(idx, dtype=np.int64), tuple(by_layout)


def _unique(items: list) -> tuple[list, np.ndarray]:
    """The distinct items in order of first appearance, and each item's position among
    them (each object hashed once: layouts repeat as the same objects)."""
    seen: dict = {}
    by_id: dict[int, int] = {}
    idx = []
    for x in items:
        i = by_id.get(id(x))
        if i is None:
            i = by_id[id(x)] = seen.setdefault(x, len(seen))
        idx.append(i)
    return list(seen), np.array(idx, dtype=np.int64)


@dataclass
class CostGraph:
    node_costs: dict[str, np.ndarray]
    edges: list[Edge]
    num_edges: int = 0            # edges of the full graph
    num_priced: int = 0           # distinct edges actually priced
    stats: dict = field(default_factory=dict)
    shared: list[SharedReads] = field(default_factory=list)   # reads priced once per layout


def build_cost_graph(graph: OpGraph, mesh: LogicalMesh, S: dict[str, list[Strategy]],
                     grouping: Grouping, costs: ReshardCosts,
                     shared: frozenset = frozenset(),
                     read_weights: dict[tuple[str, int], float] | None = None,
                     micro_batches: int = 1, state_once: bool = False,
                     rounds: dict | None = None) -> CostGraph:
    """``shared``: values (producer, index) whose operand reads are priced once per target
    layout (``passes/sharding/shared_reshard.py``) instead of once per read. ``read_weights``:
    values whose every operand read is priced at this fraction of its resharding (a
    relaxation for bounds: a value read ``k`` times costs at least ``1/k`` of what its
    reads would cost apart, however many of them share a copy). ``micro_batches``: the
    step runs the graph this many times and reduces the gradients once (gradient
    accumulation): every cost but the gradients' final resharding counts that many times.
    ``state_once`` (``plan.state_read_once``): a forward op's read of a parameter or buffer
    is resharded once per step too (``runtime/rewrites/param_gather.py``). ``rounds``: a
    dict kept by the caller across cost graphs of the same graph, strategies, grouping,
    costs and options that differ in ``shared`` alone (``solve_sharing_reads``' rounds):
    the node costs and every group of links not changed are taken from the round before,
    the same numbers added in the same order."""
    repeats = _Repeats(graph, float(micro_batches), state_once)
    rounds = {} if rounds is None or read_weights else rounds
    base = rounds.get("node costs")
    if base is None:
        base = rounds["node costs"] = _node_costs(graph, mesh, S, grouping, costs,
                                                  repeats.micro_batches, state_once)
    node_costs = {r: vec.copy() for r, vec in base.items()}
    links = _links(graph, shared)
    groups = _group_links(graph, S, grouping, links)
    edges = _price_groups(graph, S, grouping, costs, groups, node_costs, repeats,
                          read_weights or {}, rounds.setdefault("groups", {}))
    groups_shared = shared_groups(graph, S, grouping, costs, set(shared))
    order = {n.name: i for i, n in enumerate(graph)}
    for g in groups_shared:          # operand reads: once per micro-batch (or step)
        first = min((n for n in graph.ops() if any(r.node == g.value[0] for r in n.operands)),
                    key=lambda n: order[n.name])      # the read that makes the shared copy
        g.table = g.table * repeats.of(g.value[0], first.name, 0)
    return CostGraph(node_costs, edges, num_edges=len(links), num_priced=len(groups),
                     shared=groups_shared)


Link = tuple[str, int, str, object]
"""(producer, output index, consumer, how the consumer reads it: an operand slot, "grad"
for a gradient reaching its parameter, "param" for a buffer's new value)."""


@dataclass(frozen=True)
class _Repeats:
    """How many times a step pays a link: once per micro-batch, but a gradient's final
    resharding and (``state_once``) a forward op's read of a parameter or buffer once."""

    graph: OpGraph
    micro_batches: float
    state_once: bool

    def of(self, u: str, v: str, how) -> float:
        """How many times a step pays the link ``u -> v`` (read as ``how``)."""
        if how == "grad" or (self.state_once and isinstance(how, int)
                             and _state_read_in_forward(self.graph, u, v)):
            return 1.0
        return self.micro_batches


def _fold(node_costs: dict[str, np.ndarray], grouping: Grouping, name: str,
          vec: np.ndarray) -> None:
    """Add ``name``'s cost per strategy onto its representative's."""
    index = grouping.index[name]
    into = node_costs[grouping.rep[name]]
    # a repeated layer's node reads its head's strategies in order: the vector as it is
    into += vec if len(index) == len(vec) == len(into) and _is_identity(index) else \
        vec[list(index)]


_IDENTITIES: dict[int, tuple[int, ...]] = {}
"""``tuple(range(n))`` per ``n`` seen, to tell an identity index by one comparison."""


def _is_identity(index: tuple[int, ...]) -> bool:
    """Whether ``index`` is ``(0, 1, ..., n - 1)``."""
    n = len(index)
    identity = _IDENTITIES.get(n)
    if identity is None:
        identity = _IDENTITIES[n] = tuple(range(n))
    return index is identity or index == identity


_OWN_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""graph -> mesh -> node name -> (its strategy list, the node, its cost per strategy): the solves
of one graph on one view (simplified, followers freed, re-solved, each memory round's
cost graph) price each node's strategies once. The strategy list and the node are held
and compared by identity, so another strategy space or a node replaced is priced anew."""

_ALIKE_COSTS: OrderedDict = OrderedDict()
"""(mesh, what a node's price reads of it, its strategies' identities) -> (the strategies,
its cost per strategy): nodes alike but for their names -- the same op of each of a
transformer's identical layers, and of the captures of one step a search plans
(checkpointing variants, parameters gathered again) -- are priced once. The strategies
are the rules' shared, frozen objects (``PricingMemo.rule_strategies``): kept here with
the price, so their identities in the key cannot be reused by others while it lives."""

ALIKE_COSTS_MAX = 100_000
"""Entries ``_ALIKE_COSTS`` keeps (least recently used dropped first)."""


def _alike_key(graph: OpGraph, mesh: LogicalMesh | None, node, strategies) -> tuple:
    """Everything ``_own_costs`` reads of ``node`` but names (``_Alike``) with the mesh,
    and its strategies by identity. TypeError for an unhashable argument."""
    return (mesh, _alike(graph, node), tuple(map(id, strategies)))


class _Alike:
    """What a node's price reads of it but its name: its op, arguments, results, flops and
    bytes, flags, its operands' specs. Made once per node of a graph and hashed once
    (a layer's nodes are priced per view, per solve and per plan), one object for the
    nodes alike of one graph, so looking them up compares identities."""

    __slots__ = ("key", "hash")

    def __init__(self, key: tuple):
        self.key, self.hash = key, hash(key)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, _Alike) and self.hash == other.hash
                                 and self.key == other.key)


_ALIKE_NODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""graph -> node name -> (the node, its ``_Alike``), and ``_Alike`` -> itself (one object
for the nodes alike)."""


def _alike(graph: OpGraph, node) -> _Alike:
    """``node``'s ``_Alike`` (TypeError for an unhashable argument)."""
    memo = _ALIKE_NODES.setdefault(graph, {})
    found = memo.get(node.name)
    if found is not None and found[0] is node:
        return found[1]
    sig = _Alike((node.op, node.kind, node.args, node.kwargs, node.outputs, node.flops,
                  node.bytes, node.phase, node.aliases, node.is_param, node.is_grad,
                  node.is_optimizer_state, node.batched,
                  tuple(graph.spec(r) for r in node.operands)))
    sig = memo.setdefault(sig, sig)
    memo[node.name] = (node, sig)
    return sig


def _own_costs_memo(graph: OpGraph, mesh: LogicalMesh) -> dict:
    """``_OWN_COSTS``' entries of ``graph`` on ``mesh``: node name -> (strategies, node,
    costs), and ``_alike_key`` less the mesh -> (strategies, costs) as ``_ALIKE_COSTS``."""
    return _OWN_COSTS.setdefault(graph, {}).setdefault(mesh, {})


def _own_costs(graph: OpGraph, mesh: LogicalMesh, node, strategies: list[Strategy],
               memo: dict | None = None) -> np.ndarray:
    """``node``'s compute and internal all-reduces per strategy, once per step; ``memo``:
    this graph's and mesh's entries of ``_OWN_COSTS`` (``_own_costs_memo``)."""
    memo = _own_costs_memo(graph, mesh) if memo is None else memo
    found = memo.get(node.name)
    if found is not None and found[0] is strategies and found[1] is node:
        return found[2]
    try:
        key = _alike_key(graph, mesh, node, strategies)
    except TypeError:        # an unhashable argument: priced on its own
        key = None
    # nodes alike in this graph (a transformer's layers) find it here, without hashing the
    # mesh again; the first of them in ``_ALIKE_COSTS`` (other graphs: a search's captures)
    alike = None if key is None else memo.get(key[1:])
    if alike is None and key is not None:
        alike = _ALIKE_COSTS.get(key)
        if alike is not None:
            _ALIKE_COSTS.move_to_end(key)
            memo[key[1:]] = alike
    if alike is not None:
        vec = alike[1]
    else:
        vec = np.array([compute_cost(mesh, node, s.shards, s.outputs,
                                     strategy_bytes(graph, node, s.inputs, s.outputs,
                                                    mesh.shape))
                        + steps_cost(mesh, sync_steps(s, node.outputs[0], mesh.shape))
                        + batch_sync_cost(mesh, s.batch_syncs) for s in strategies])
        vec.setflags(write=False)
        if key is not None:
            _ALIKE_COSTS[key] = memo[key[1:]] = (tuple(strategies), vec)
            while len(_ALIKE_COSTS) > ALIKE_COSTS_MAX:
                _ALIKE_COSTS.popitem(last=False)
    memo[node.name] = (strategies, node, vec)
    return vec


_COMPUTE_BY_MESH: OrderedDict = OrderedDict()
"""mesh -> (what a node's price reads of it but names, its strategy's identity) -> (the
strategy, its compute seconds): ``op_compute_seconds``'s memo, as ``_ALIKE_COMPUTE``'s."""


_LAST_COMPUTE_MESH: list = []
"""[the mesh ``op_compute_seconds`` last priced on, its ``_COMPUTE_BY_MESH`` entry]."""


def op_compute_seconds(graph: OpGraph, mesh: LogicalMesh, node, s: Strategy) -> float:
    """``compute_cost`` of ``node`` under strategy ``s`` on the bytes its blocks move
    (what a plan's estimate sums per op), priced once for nodes alike but for their
    names (``_alike_key``)."""
    last = _LAST_COMPUTE_MESH
    if last and last[0] is mesh:     # a plan's ops ask on one mesh object: hashed once
        memo = last[1]
    else:
        memo = _COMPUTE_BY_MESH.get(mesh)
        if memo is None:
            memo = _COMPUTE_BY_MESH[mesh] = {}
            while len(_COMPUTE_BY_MESH) > 16:
                _COMPUTE_BY_MESH.popitem(last=False)
        _LAST_COMPUTE_MESH[:] = [mesh, memo]
    try:
        key = _alike_key(graph, None, node, (s,))
        found = memo.get(key)
    except TypeError:        # an unhashable argument: priced on its own
        key, found = None, None
    if found is not None:
        return found[1]
    seconds = compute_cost(mesh, node, s.shards, s.outputs,
                           strategy_bytes(graph, node, s.inputs, s.outputs, mesh.shape))
    if key is not None:
        if len(memo) >= ALIKE_COSTS_MAX:
            memo.clear()
        memo[key] = (s, seconds)
    return seconds


def _node_costs(graph: OpGraph, mesh: LogicalMesh, S: dict[str, list[Strategy]],
                grouping: Grouping, costs: ReshardCosts, k: float,
                state_once: bool = False) -> dict[str, np.ndarray]:
    """Per representative and strategy: its nodes' compute and internal all-reduces, and
    the loss and the values sent to other stages made whole, ``k`` times a step (a
    parameter sent to another stage once, with ``state_once``: gathered once per step; a
    summed gradient part once)."""
    node_costs = {r: np.zeros(len(S[r])) for r in grouping.representatives}
    memo = _own_costs_memo(graph, mesh)
    for node in graph.ops():
        _fold(node_costs, grouping, node.name, k * _own_costs(graph, mesh, node, S[node.name],
                                                              memo))
    # the loss is returned whole, and values for other pipeline stages are sent whole
    R = replicated(mesh.ndim)
    whole = ([graph.outputs.loss] if graph.outputs.loss is not None else []) + \
        list(graph.outputs.sends)
    for ref in whole:
        # a gradient part the receiver only adds into a parameter's gradient is summed
        # over the micro-batches and made whole once per step, after the last backward
        # (``meta["summed_sends"]``; runtime/execution/pipeline.py), as the plan prices it
        times = 1.0 if (state_once and graph.node(ref.node).kind == "param") or \
            str(ref) in graph.meta.get("summed_sends", ()) else k
        # a send crossing batch-split is laid out so (passes/sharding/stage_boundary.py)
        to = R if ref == graph.outputs.loss else \
            boundary_layout(graph, str(ref), graph.spec(ref), mesh) or R
        _fold(node_costs, grouping, ref.node, times * np.array([
            costs.cost(graph.spec(ref), s.outputs[ref.index], to) for s in S[ref.node]]))
    return node_costs


def _links(graph: OpGraph, shared: frozenset) -> list[Link]:
    """Every link the ILP prices: operand reads (but of ``shared`` values, priced once
    per layout), gradients to their parameters, new buffer values to their buffers."""
    links: list[Link] = []
    for node in graph.ops():
        for slot, ref in enumerate(node.operands):
            if (ref.node, ref.index) not in shared:
                links.append((ref.node, ref.index, node.name, slot))
    params = graph.params
    for fqn, ref in graph.outputs.grads:
        links.append((ref.node, ref.index, params[fqn], "grad"))
    buffers = {n.target: n.name for n in graph if n.kind == "buffer"}
    for fqn, ref in graph.outputs.buffer_updates:   # new buffer values take its layout
        links.append((ref.node, ref.index, buffers[fqn], "param"))
    return links


def _group_links(graph: OpGraph, S: dict[str, list[Strategy]], grouping: Grouping,
                 links: list[Link]) -> dict[tuple, list[Link]]:
    """Links that price alike (same representatives, strategies, value and read
    layouts), each group priced once."""
    rep, index = grouping.rep, grouping.index
    groups: dict[tuple, list[Link]] = defaultdict(list)
    # the read layouts as small ints, one per distinct tuple of them: alike nodes hold
    # the rules' shared strategies, so a strategy list's layouts are hashed once
    # (placements hash in Python), not once per link
    by_ids: dict[tuple, int] = {}
    numbers: dict[tuple, int] = {}
    ids_of: dict[str, tuple] = {}       # a consumer's strategies' identities, once per node
    for u, idx, v, how in links:
        strategy_ids = ids_of.get(v)
        if strategy_ids is None:
            strategy_ids = ids_of[v] = tuple(map(id, S[v]))
        ids = (strategy_ids, how)
        read = by_ids.get(ids)
        if read is None:
            read = by_ids[ids] = numbers.setdefault(_read_layouts_key(S[v], how), len(numbers))
        key = (rep[u], rep[v], index[u], index[v], graph.node(u).outputs[idx], idx, read)
        groups[key].append((u, idx, v, how))
    return groups


def _price_groups(graph: OpGraph, S: dict[str, list[Strategy]], grouping: Grouping,
                  costs: ReshardCosts, groups: dict[tuple, list[Link]],
                  node_costs: dict[str, np.ndarray], repeats: _Repeats,
                  weights: dict[tuple[str, int], float], done: dict | None = None
                  ) -> list[Edge]:
    """Each group's resharding table, times how often a step pays its links; a group
    within one representative adds its diagonal to the node's costs, the others are the
    ILP's edges. ``done``: (group, its links) -> what an earlier cost graph of the same
    problem priced for them (``build_cost_graph``'s ``rounds``), taken as it was."""
    index = grouping.index
    edges: list[Edge] = []
    saved = saved_views(graph) if done is None or not done else done["saved views"]
    if done is not None:
        done["saved views"] = saved
    for key, members in groups.items():
        ru, rv = key[0], key[1]
        found = None if done is None else done.get((key, tuple(members)))
        if found is not None:
            if ru == rv:
                node_costs[ru] += found
            else:
                edges.append(Edge(found.u, found.v, found.row_of.copy(),
                                  found.col_of.copy(), found.table.copy()))
            continue
        u, idx, v, how = members[0]
        rows = [S[u][a].outputs[idx] for a in index[u]]
        cols = [_reads(S[v][b], how) for b in index[v]]
        spec = graph.node(u).outputs[idx]
        e = costs.edge(ru, rv, spec, rows, cols, gradient=how == "grad")
        if RESLICE_REDUCTION in costs.forbidden and isinstance(how, int) \
                and op_family(graph.node(v).op) in REDUCTIONS:
            _forbid_reslicing(e, costs, spec, rows, cols)
        if REGATHER_SAVED_VIEWS in costs.forbidden and v in saved and ru != rv and \
                graph.node(u).kind not in ("param", "buffer"):
            _forbid_gathers(e, spec, rows, cols, costs.mesh.shape)
        e.table = e.table * sum((weights.get((m[0], m[1]), 1.0) if isinstance(m[3], int) else 1.0)
                                * repeats.of(m[0], m[2], m[3]) for m in members)
        if ru == rv:   # both ends follow one node: only its diagonal can happen
            diagonal = e.dense().diagonal()
            node_costs[ru] += diagonal
            if done is not None:
                done[(key, tuple(members))] = diagonal
        else:
            if done is not None:
                done[(key, tuple(members))] = Edge(e.u, e.v, e.row_of, e.col_of,
                                                   e.table.copy())
            edges.append(e)
    return edges


def _forbid_reslicing(e: Edge, costs: ReshardCosts, spec: TensorSpec, rows: list,
                      cols: list) -> None:
    """Make the reads of ``e`` (an edge into a reduction) that only slice impossible."""
    urows, _ = _unique(rows)
    ucols, _ = _unique(cols)
    for i, src in enumerate(urows):
        for j, dst in enumerate(ucols):
            if costs.reslices(spec, src, dst):
                e.table[i, j] = math.inf


def saved_views(graph: OpGraph) -> frozenset[str]:
    """Forward views whose storage backward reads (through them or views of them)."""
    readers: dict[str, list] = defaultdict(list)
    for node in graph.ops():
        for ref in node.operands:
            readers[ref.node].append(node)

    def read_in_backward(name: str, depth: int = 0) -> bool:
        return depth < 16 and any(r.phase != "forward" or (
            r.aliases and read_in_backward(r.name, depth + 1)) for r in readers[name])
    return frozenset(n.name for n in graph.ops()
                     if n.aliases and n.phase == "forward" and read_in_backward(n.name))


def _forbid_gathers(e: Edge, spec: TensorSpec, rows: list, cols: list, mesh_shape) -> None:
    """No forward view that backward reads may gather its operand: the gathered copy would
    live until backward whole, where the memory model prices a view in its operand's
    layout. The gather happens at the view's readers instead, again in backward for
    backward's (Megatron's sequence parallelism gathers the norm's output twice too)."""
    urows, ucols = _unique(rows)[0], _unique(cols)[0]
    for i, src in enumerate(urows):
        for j, dst in enumerate(ucols):
            if dst is not None and local_bytes(spec, dst, mesh_shape) > \
                    local_bytes(spec, src, mesh_shape):
                e.table[i, j] = math.inf


def _state_read_in_forward(graph: OpGraph, producer: str, consumer: str) -> bool:
    """Whether ``consumer`` is a forward op reading a parameter or buffer."""
    return graph.node(producer).kind in ("param", "buffer") and \
        graph.node(consumer).phase == "forward"


def _reads(s: Strategy, how) -> Placements | None:
    return s.outputs[0] if how in ("param", "grad") else s.inputs[how]


def _read_layouts_key(strategies: list[Strategy], how) -> tuple:
    return (how, tuple(_reads(s, how) for s in strategies))


def solve_sharing_reads(graph: OpGraph, mesh, S: dict, grouping, costs, solve,
                        initial=None, shared: frozenset = frozenset(), micro_batches: int = 1,
                        state_once: bool = False, share_state: bool = False):
    """Solve, then price the values the plan reshards alike for two reads once per layout
    and solve again from that plan, until no such value is priced per read.
    ``solve(cost_graph, initial) -> (ILPSolution, node -> Strategy)``; ``shared``: values
    priced so from the first solve (those an earlier solve of the same graph found: each
    round found again costs a whole solve). Returns the last (cost graph, solution, chosen
    strategies, values priced once per layout). ``share_state``: parameters' reads may
    share a copy too (``shared_reshard.read_key``)."""
    rounds: dict = {}       # what the rounds share (build_cost_graph)
    for _ in range(SHARING_ROUNDS):
        cg = build_cost_graph(graph, mesh, S, grouping, costs, shared,
                              micro_batches=micro_batches, state_once=state_once,
                              rounds=rounds)
        solution, chosen = solve(cg, initial)
        more = duplicated_reads(graph, chosen, costs.steps, share_state) - shared
        if not more:
            break
        shared, initial = shared | more, solution.choice
    else:
        log.warning("the plan reshards some values alike for two reads after %d solves; its "
                    "objective prices those reads once each", SHARING_ROUNDS)
    return cg, solution, chosen, shared
