"""One resharded copy of a value per target layout, however many ops read it.

When two ops read the same value in the same layout (batch norm's forward and its backward
both reading a partial convolution output as a whole one), the runtime reshards it once and
both read the result (``Reshard.same_as``), as XLA's common-subexpression elimination does
after Alpa's ILP. The ILP must price that once too, or it overprices every plan that reads
a resharded value twice. Pairwise edge costs cannot say "once per target": the cost of a
value's reads is ``sum over distinct targets d of cost(src -> d)``.

So a value whose reads are priced this way is a ``SharedReads`` group, kept out of the
ordinary edges: per read ``k`` an indicator ``e_k[p, d]`` (the producer writes ``p``, the
read wants ``d``; linked to both sides' strategy variables as an ordinary edge is), and per
pair a ``w[p, d] >= e_k[p, d]`` for every read, priced ``cost(p -> d)``. Minimizing drives
``w`` to the largest indicator: paid once when any read wants ``d``. The ILP's builder
(``passes/sharding/ilp_model.py::add_shared_reads``) writes these for both solvers.

Which values: those the plan found reads twice in one layout. Pricing every value with
several readers this way would keep ``passes/sharding/presolve.py`` from reducing any of their
nodes (its rewrites assume additive edge costs), so ``plan_intra_op`` starts with none,
and adds the values its plan reshards identically for two reads (``duplicated_reads``),
then solves again, until the plan has no duplicate the ILP priced twice. The objective is
then the plan's true cost; a plan that would share a reshard the ILP never saw shared may
be missed.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from torchalpa.core.opgraph import OpGraph, ValueRef

__all__ = ["SharedReads", "duplicated_reads", "shared_groups", "shared_reads_cost",
           "multi_read_values", "ValueKey", "SHARING_ROUNDS"]

log = logging.getLogger("torchalpa.planner")
SHARING_ROUNDS = 6    # solves that may add values whose reads share one resharded copy

ValueKey = tuple[str, int]
"""(producer node, result index)."""


@dataclass
class SharedReads:
    """The reads of one value, priced once per distinct target layout.

    ``rows[a]``: the source layout id of the producer's (representative's) strategy ``a``;
    ``reads``: per read, its consumer's representative and ``targets[b]``, the target
    layout id its strategy ``b`` reads; ``table[p, d]``: seconds from source ``p`` to
    target ``d`` (inf: impossible)."""

    value: ValueKey
    producer: str
    rows: np.ndarray
    reads: list[tuple[str, np.ndarray]]
    table: np.ndarray

    @property
    def nodes(self) -> set[str]:
        return {self.producer} | {v for v, _ in self.reads}


def duplicated_reads(graph: OpGraph, chosen: dict, steps_of, share_state: bool = False
                     ) -> set[ValueKey]:
    """Values that ``chosen`` (node -> Strategy) reshards with the same collective steps for
    two operand reads; ``steps_of(spec, src, dst)`` gives the steps; ``share_state``: as
    ``read_key``'s."""
    seen: dict[tuple, int] = defaultdict(int)
    for ref, spec, state, consumer, slot, forward in _operand_reads(graph):
        if state and not share_state:
            continue
        key = _key(ref, state, forward, steps_of(spec, chosen[ref.node].outputs[ref.index],
                                                 chosen[consumer].inputs[slot]))
        if key is not None:
            seen[key] += 1
    return {key[0] for key, count in seen.items() if count > 1}


_READS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""graph -> ``_operand_reads``: each solve of each view looks its reads over again."""


def _operand_reads(graph: OpGraph) -> list[tuple]:
    """Each operand read of ``graph``, in order: (the value's ref, its spec, whether it
    is a parameter or buffer, the consumer, the slot, whether the consumer is forward)."""
    found = _READS.get(graph)
    if found is None:
        found = _READS[graph] = [
            (ref, graph.spec(ref), graph.node(ref.node).kind in ("param", "buffer"),
             node.name, slot, node.phase == "forward")
            for node in graph.ops() for slot, ref in enumerate(node.operands)]
    return found


def _key(ref: ValueRef, state: bool, forward: bool, steps):
    """``read_key`` of a read resharded by ``steps``."""
    if not steps or not any(s.is_collective for s in steps):
        return None
    if not state and any(s.kind == "all_gather" for s in steps):
        return (ref.node, ref.index), tuple(steps), forward
    return (ref.node, ref.index), tuple(steps)


def multi_read_values(graph: OpGraph) -> frozenset[ValueKey]:
    """Every value two or more operand reads take: where sharing could pay (pricing them
    all shared is the exact problem, for small graphs and tests)."""
    count: dict[ValueKey, int] = defaultdict(int)
    for node in graph.ops():
        for ref in node.operands:
            count[(ref.node, ref.index)] += 1
    return frozenset(k for k, c in count.items() if c > 1)


def read_key(graph: OpGraph, chosen: dict, steps_of, ref: ValueRef, dst,
             share_state: bool = False, phase: str = "forward"):
    """What makes two reads share a resharded copy: the value and the steps. None when
    the read needs no collective (nothing worth sharing), or reads a parameter or buffer
    and ``share_state`` is False: a gathered weight kept from forward to backward is the
    memory ZeRO-3 (``rematerialize_parameters``) saves by gathering it again. Otherwise
    (ZeRO-2) a parameter gathered once serves every read of it in that layout, forward's
    and backward's, as XLA's common-subexpression elimination merges Alpa's gathers. A
    gathered activation is not kept from forward to backward (the memory model does not
    price resharded copies): a read in ``phase`` "backward" gathers it again, as
    Megatron's sequence parallelism gathers a norm's output twice."""
    state = graph.node(ref.node).kind in ("param", "buffer")
    if state and not share_state:
        return None
    return _key(ref, state, phase == "forward",
                steps_of(graph.spec(ref), chosen[ref.node].outputs[ref.index], dst))


def shared_groups(graph: OpGraph, S: dict, grouping, costs, values: set[ValueKey]
                  ) -> list[SharedReads]:
    """A ``SharedReads`` for each value in ``values`` (its operand reads only: gradients,
    the loss and buffer updates are resharded in other programs and never shared)."""
    reads: dict[ValueKey, list[tuple[str, int]]] = defaultdict(list)
    for node in graph.ops():
        for slot, ref in enumerate(node.operands):
            if (ref.node, ref.index) in values:
                reads[(ref.node, ref.index)].append((node.name, slot))
    rep, index = grouping.rep, grouping.index
    groups = []
    for (u, idx), readers in reads.items():
        spec = graph.node(u).outputs[idx]
        sources: dict = {}
        rows = np.array([sources.setdefault(S[u][a].outputs[idx], len(sources))
                         for a in index[u]], dtype=np.int64)
        targets: dict = {}
        per_read = []
        for v, slot in readers:
            ids = np.array([targets.setdefault(S[v][b].inputs[slot], len(targets))
                            for b in index[v]], dtype=np.int64)
            per_read.append((rep[v], ids))
        table = np.array([[costs.cost(spec, src, dst) for dst in targets] for src in sources])
        groups.append(SharedReads((u, idx), rep[u], rows, per_read, table))
    return groups


def shared_reads_cost(group: SharedReads, choice: dict[str, int]) -> float:
    """What ``choice`` (representative -> strategy index) pays for the group's reads."""
    p = group.rows[choice[group.producer]]
    wanted = {int(targets[choice[v]]) for v, targets in group.reads}
    return float(sum(group.table[p, d] for d in wanted))

