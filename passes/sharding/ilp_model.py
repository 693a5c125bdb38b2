"""The intra-op ILP as plain arrays: built once, handed to either solver.

``passes/sharding/ilp.py`` states the problem (one-hot strategy choices, layout-pair edge variables,
values whose reads share one resharded copy, memory groups) and reduces it; this module
writes the reduced problem as columns (name, objective coefficient, upper bound,
integrality; every lower bound is 0) and sparse rows with lower and upper bounds. Two
writers read it: HiGHS takes the arrays directly (``passes/sharding/ilp_highs.py``), CBC gets them
through PuLP's MPS file (``passes/sharding/ilp.py``). Building in bulk matters: profiling the
pipeline search (GPT-1.3B on 4 H100s, 58 intra-op solves) showed PuLP's model building --
one Python object per variable and per term -- taking longer than HiGHS itself.

Column names are the ones the model has always had (``s{node}_{strategy}``,
``e{edge}_{p}_{q}``, ``g{group}_...``, ``peak_bytes``): both writers order columns by name,
as PuLP does, so a seeded single-threaded solver sees the same model and returns the same
choice whichever writer fed it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torchalpa.passes.sharding.shared_reshard import SharedReads

__all__ = ["FIXED", "LinearModel", "BuiltModel", "build_model", "add_shared_reads"]

FIXED = -1
"""The "column" of a node's only strategy: the constant 1, which ``LinearModel.row`` moves
into the row's bounds."""


@dataclass
class LinearModel:
    """Columns and rows (CSR: ``starts``, ``index``, ``value``) of a minimization."""

    names: list[str] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=list)
    value: list[float] = field(default_factory=list)
    initial: dict[int, float] = field(default_factory=dict)
    """Column -> value of a feasible start (strategy columns only), for a warm start."""

    def column(self, name: str, cost: float, upper: float, integer: bool) -> int:
        self.names.append(name)
        self.cost.append(cost)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.names) - 1

    def columns(self, names: list[str], costs: list[float]) -> int:
        """Continuous columns in ``[0, 1]``, one per name, as ``column`` adds them one by
        one (the edges' many columns in bulk); the first one's index."""
        first = len(self.names)
        self.names += names
        self.cost += costs
        self.upper += [1.0] * len(names)
        self.integer += [False] * len(names)
        return first

    def row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        """``lower <= sum coefficient * column <= upper``; ``FIXED`` terms move to the bounds."""
        self.starts.append(len(self.index))
        for col, coefficient in terms:
            if col == FIXED:
                lower, upper = lower - coefficient, upper - coefficient
            elif coefficient != 0:
                self.index.append(col)
                self.value.append(coefficient)
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    def link_rows(self, held: list[list[int]], sources: list[list[int]]) -> None:
        """Per pair with a non-empty source, ``sum(held) - sum(source) == 0`` as ``row``
        writes it (held at +1 then source at -1, ``FIXED`` moved into the bounds): the
        linking rows of an edge in one call instead of one ``row`` call each."""
        for plus, minus in zip(held, sources):
            if not minus:
                continue
            bound = 0.0
            if FIXED in minus:
                for col in minus:
                    if col == FIXED:
                        bound -= -1.0
                minus = [col for col in minus if col != FIXED]
            self.starts.append(len(self.index))
            self.index += plus
            self.index += minus
            self.value += [1.0] * len(plus)
            self.value += [-1.0] * len(minus)
            self.row_lower.append(bound)
            self.row_upper.append(bound)

    def rows(self):
        """(lower, upper, columns, coefficients) per row, in order."""
        ends = self.starts[1:] + [len(self.index)]
        for r, (begin, end) in enumerate(zip(self.starts, ends)):
            yield self.row_lower[r], self.row_upper[r], self.index[begin:end], self.value[begin:end]


@dataclass
class BuiltModel:
    """The model with what is needed to read a solution back: per node its strategies'
    columns (``FIXED`` for a node's only strategy, None for a forbidden one), the peak
    column (``minimize_peak``) and the scale of byte coefficients."""

    model: LinearModel
    strategy_columns: dict[str, list[int | None]]
    peak: int | None
    mem_scale: float

    def choice(self, values: np.ndarray) -> dict[str, int]:
        """Node -> the strategy whose column is set in ``values`` (column order)."""
        return {k: 0 if len(cols) == 1 else
                int(np.argmax([0.0 if c is None else values[c] for c in cols]))
                for k, cols in self.strategy_columns.items()}


def build_model(costs: dict[str, np.ndarray], edges: list, shared: list[SharedReads], reduced,
                memory_terms: list, memory_budget: float | None, minimize_peak: bool,
                scale: float, initial: dict[str, int] | None = None,
                kept: list | None = None) -> BuiltModel:
    """The reduced problem (``presolve``'s costs and edges, costs multiplied by ``scale``)
    as a ``LinearModel``; ``reduced`` supplies the bytes of nodes it decided, ``shared``
    the ``SharedReads`` groups, ``initial`` (node -> strategy) a start, ``kept`` per
    memory group its ``KeptTerm``s (their nodes kept out of presolve)."""
    model = LinearModel()
    s: dict[str, list[int | None]] = {}
    for idx, (k, c) in enumerate(costs.items()):
        if len(c) == 1:
            s[k] = [FIXED]
            continue
        s[k] = [model.column(f"s{idx}_{a}", float(c[a] * scale), 1.0, True)
                if math.isfinite(c[a]) else None for a in range(len(c))]
        model.row([(col, 1.0) for col in s[k] if col is not None], 1.0, 1.0)
        if initial is not None and k in initial:
            model.initial.update((col, 1.0 if a == initial[k] else 0.0)
                                 for a, col in enumerate(s[k]) if col is not None)
    for eidx, e in enumerate(edges):
        _add_edge(model, s, e, f"e{eidx}", scale)
    for gidx, group in enumerate(shared):
        add_shared_reads(model, s, group, f"g{gidx}", scale)
    peak = model.column("peak_bytes", 0.0, math.inf, False) if minimize_peak else None
    mem_scale = 1.0 / max(1.0, max((float(np.max(m)) for g in memory_terms for m in g.values()),
                                   default=1.0))
    if memory_budget is not None or peak is not None:
        shared_y: dict = {}      # KeptTerm.key -> its y, one column for every point
        for gidx, group in enumerate(memory_terms):
            terms, fixed = [], 0.0
            if kept and gidx < len(kept):
                terms += [(_kept_column(model, s, term, f"k{gidx}_{tidx}", shared_y),
                           term.nbytes * mem_scale) for tidx, term in enumerate(kept[gidx])]
            for k, mem in group.items():
                if k not in s:
                    fixed += reduced.fixed_bytes(k, mem) * mem_scale
                elif len(s[k]) == 1:
                    fixed += float(mem[0]) * mem_scale
                else:
                    terms += [(col, float(mem[a]) * mem_scale) for a, col in enumerate(s[k])
                              if col is not None and mem[a] != 0]
            if peak is not None:
                model.row(terms + [(peak, -1.0)], -math.inf, -fixed)
            else:
                assert memory_budget is not None
                model.row(terms, -math.inf, memory_budget * mem_scale - fixed)
    if peak is not None:    # the objective is the peak alone
        model.cost = [0.0] * len(model.cost)
        model.cost[peak] = 1.0
    return BuiltModel(model, s, peak, mem_scale)


def _kept_column(model: LinearModel, s: dict, term, tag: str, shared_y: dict) -> int:
    """``y``, 1 when ``term``'s copy is alive and no view of it already counts there:
    ``y >= x_copy_from + x_first + x_second - 2 - x_covered`` per pair of readers (each
    ``x`` the sum of the marked strategies' columns, ``FIXED`` for a node's only
    strategy). Only the memory row holds ``y``, so a plan keeping no copy can set it to 0
    and one keeping it pays its bytes once: the row stays exact. Terms of one ``key`` (the
    same copy at other points) share one ``y`` and its rows."""
    key = getattr(term, "key", None)
    if key is not None and key in shared_y:
        return shared_y[key]
    y = model.column(tag, 0.0, 1.0, False)
    if key is not None:
        shared_y[key] = y

    def chosen(node: str, mask) -> list[tuple[int, float]]:
        return [(col, -1.0) for col, marked in zip(s[node], mask)
                if marked and col is not None]

    source = chosen(term.producer, term.copy_from)
    covered = [(col, -c) for node, mask in term.covered for col, c in chosen(node, mask)]
    for first, first_mask, second, second_mask in term.pairs:
        # one coefficient per column: a reader may be both of a pair (grouped readers
        # share a representative) or covered too, and HiGHS refuses repeated columns
        merged: dict[int, float] = {}
        for col, c in [(y, 1.0)] + source + chosen(first, first_mask) + \
                chosen(second, second_mask) + covered:
            merged[col] = merged.get(col, 0.0) + c
        model.row(list(merged.items()), -2.0, math.inf)
    return y


def layout_columns(columns: list[int | None], layout_of: np.ndarray, size: int
                   ) -> list[list[int]]:
    """Per layout id, the columns of the strategies that use it (forbidden ones left out)."""
    out: list[list[int]] = [[] for _ in range(size)]
    for col, layout in zip(columns, layout_of):
        if col is not None:
            out[int(layout)].append(col)
    return out


def _add_edge(model: LinearModel, s: dict, e, tag: str, scale: float) -> None:
    """Edge ``e``'s variables ``e[p, q]`` (one per finite layout pair both sides can take)
    and their linking rows: the sum over ``q`` equals the producer's strategies writing
    ``p``, the sum over ``p`` the consumer's strategies reading ``q``. Built per edge in
    bulk (numpy masks, one ``link_rows`` per side), in the order, names and values a loop
    over ``p`` then ``q`` with one ``row`` call per linking row gives."""
    P, Q = e.table.shape
    row_sources = layout_columns(s[e.u], e.row_of, P)
    col_sources = layout_columns(s[e.v], e.col_of, Q)
    taken = (np.isfinite(e.table) & np.array([bool(x) for x in row_sources])[:, None]
             & np.array([bool(x) for x in col_sources])[None, :])
    ps, qs = np.nonzero(taken)            # row-major: p outer, q inner
    names = [f"{tag}_{p}_{q}" for p, q in zip(ps.tolist(), qs.tolist())]
    first = model.columns(names, (e.table * scale)[taken].tolist())
    ends = (first + np.cumsum(taken.sum(axis=1))).tolist()
    rows = [list(range(end - n, end)) for end, n in zip(ends, taken.sum(axis=1).tolist())]
    by_q = (first + np.argsort(qs, kind="stable")).tolist()
    col_ends = np.cumsum(taken.sum(axis=0)).tolist()
    cols = [by_q[end - n:end] for end, n in zip(col_ends, taken.sum(axis=0).tolist())]
    model.link_rows(rows, row_sources)
    model.link_rows(cols, col_sources)


def add_shared_reads(model: LinearModel, s: dict, group: SharedReads, tag: str,
                     scale: float) -> None:
    """Write ``group``'s variables and rows into ``model`` (``s``: node -> its strategies'
    columns, ``FIXED`` for a node's only strategy, None for a forbidden one)."""
    P, D = group.table.shape
    charges: dict[tuple[int, int], int] = {}

    def charge(p: int, d: int) -> int:
        """``w[p, d]``, the price of resharding from ``p`` to ``d`` once."""
        if (p, d) not in charges:
            charges[(p, d)] = model.column(f"{tag}_w{p}_{d}", float(group.table[p, d] * scale),
                                           1.0, False)
        return charges[(p, d)]

    sources = layout_columns(s[group.producer], group.rows, P)
    for k, (v, targets) in enumerate(group.reads):
        if v == group.producer:        # the reader follows the producer: its own choice
            for p in range(P):
                for d in range(D):
                    chosen = [x for a, x in enumerate(s[v]) if x is not None and
                              group.rows[a] == p and targets[a] == d]
                    if not chosen or group.table[p, d] == 0:
                        continue
                    if math.isfinite(group.table[p, d]):     # w[p, d] >= the choice
                        model.row([(charge(p, d), 1.0)] + [(x, -1.0) for x in chosen],
                                  0.0, math.inf)
                    else:              # a layout it cannot read this value in
                        model.row([(x, 1.0) for x in chosen], 0.0, 0.0)
            continue
        wanted = layout_columns(s[v], targets, D)
        rows: list[list[int]] = [[] for _ in range(P)]
        cols: list[list[int]] = [[] for _ in range(D)]
        for p in range(P):
            for d in range(D):
                if not sources[p] or not wanted[d] or not math.isfinite(group.table[p, d]):
                    continue
                e = model.column(f"{tag}_e{k}_{p}_{d}", 0.0, 1.0, False)
                rows[p].append(e)
                cols[d].append(e)
                if group.table[p, d] != 0:                    # w[p, d] >= e_k[p, d]
                    model.row([(charge(p, d), 1.0), (e, -1.0)], 0.0, math.inf)
        for sums, needed in ((rows, sources), (cols, wanted)):
            for held, source in zip(sums, needed):
                if source:
                    model.row([(x, 1.0) for x in held] + [(x, -1.0) for x in source], 0.0, 0.0)
