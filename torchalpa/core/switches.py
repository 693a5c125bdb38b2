"""The planner's A/B switches: the fast paths a test or benchmark turns off to compare.

Each fast path of the search was measured against what the search did before it, and the
two must give the same plan (or, for ``search_gap``, one no slower); tests and benchmarks
keep checking that by running both. The switches are typed, frozen records, one per layer
that reads them -- ``PassSwitches`` for ``passes/`` (the ILP and the pipeline search),
``SearchSwitches`` for ``torchalpa/parallel/`` (the method search) -- kept here in core so
both layers can read theirs without importing each other. Every default is the fast
path: nothing outside a test or benchmark sets them.

Read one with ``PassSwitches.current().layer_classes``; turn one off for a block with
``with SearchSwitches.using(seed_sharing=False): ...`` (nested blocks change only the
fields they name, and the values before come back on leaving, also on an error). The
values live in a ``contextvars.ContextVar``: a forked search worker inherits the ones set
where it was forked, and another thread sees the defaults.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["PassSwitches", "SearchSwitches"]

_S = TypeVar("_S", bound="_Switches")

_current: contextvars.ContextVar[dict[type, object] | None] = contextvars.ContextVar(
    "torchalpa_switches", default=None)


class _Switches:
    """What every switch record offers: its values now, and a block that changes some."""

    __slots__ = ()

    @classmethod
    def current(cls: type[_S]) -> _S:
        """The values in force here (the defaults unless a ``using`` block set others)."""
        found = (_current.get() or {}).get(cls)
        return found if isinstance(found, cls) else cls()

    @classmethod
    @contextlib.contextmanager
    def using(cls: type[_S], **changes: bool) -> Iterator[_S]:
        """Within the block, the values now with ``changes``; a name that is no field of
        ``cls`` is a TypeError (``dataclasses.replace``)."""
        values = dataclasses.replace(cls.current(), **changes)  # type: ignore[type-var]
        token = _current.set({**(_current.get() or {}), cls: values})
        try:
            yield values
        finally:
            _current.reset(token)


@dataclass(frozen=True, kw_only=True, slots=True)
class PassSwitches(_Switches):
    """The fast paths of ``passes/``: each False takes the way the pass went before."""

    direct_highs: bool = True
    """Hand HiGHS the model's arrays (``passes/sharding/ilp_highs.py``) instead of writing
    them through PuLP: the same model and answer, loaded several times faster; False takes
    the PuLP path (``ilp.solve_ilp``)."""

    layer_classes: bool = True
    """Group a layer's views into classes by the layer's own dims
    (``LayerCosts.view_class``), not every dim of the step: a decoder layer's views part
    only where its own values divide differently. False: by the step's dims."""

    copy_replicated: bool = True
    """Give a view the estimates of its class's solved view where the two differ only in
    axes that divide no dim of the layer (``LayerCosts.replicated_alike``); False prices
    each."""

    trust_proofs: bool = True
    """A pipeline stage the solver proves no plan fits (with the method's parameters) is
    not solved again with sharded states (``ExactStages._solve_stage``); False solves it
    all the same, as the search did before (``benchmarks/stage_unfit_ab.py`` compares)."""

    stage_floor: bool = True
    """A pipeline stage whose memory floor is above its budget (every plan, each value
    at its least, holds more at some point: ``stage_solve.cannot_fit``) costs inf
    without an ILP (``ExactStages._solve_stage``); False leaves every such stage to its
    ILPs, as the search did before."""

    view_floor: bool = True
    """A whole graph's intra-op solve on one logical view (``plan_graph``: ShardParallel,
    AutoParallel's intra-op candidates and data-parallel layouts) whose memory floor is
    above its budget ends "does not fit" without an ILP (``view_floor.floor_refusal``);
    False leaves every such view to its ILPs, as the planner did before."""

    stage_bounds: bool = True
    """The stage DP's rounds leave unsolved a stage variant (another logical view, or
    recomputed) whose LP bound is above the stage's exact price found already: it could
    not lower the stage's price (``StageSearch._cut_by_bounds``); False solves every
    variant the DP picks, as the search did before."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSwitches(_Switches):
    """The fast paths of the method search in ``torchalpa/parallel/``: each False takes
    the way the search went before."""

    search_gap: bool = True
    """Solve the intra-op candidates' ILPs to within the search's ``tolerance`` (HiGHS'
    ``mip_rel_gap``) and re-solve, at the solver's own gap, only the views whose plan that
    gap could keep from winning (``auto._Search.polish``); False solves every view at the
    solver's own gap (benchmarks/near_budget_ab.py compares)."""

    seed_sharing: bool = True
    """Start each intra-op candidate's ILPs with the values the candidates before found
    read twice alike on the same view (``plan_intra_op(sharing=)``): the sharing round that
    would find them again is a whole solve; False starts every candidate afresh."""

    reuse_views: bool = True
    """Settle an intra-op candidate's view (logical mesh) by another candidate's answer on
    it instead of solving it (``auto._Search.settled_views``); False solves every view."""

    relaxed_bounds: bool = True
    """Refuse a checkpointing intra-op candidate, once a plan is in hand, where the linear
    relaxations of its views bound it at what cannot beat that plan by more than the
    tolerance (``auto._Search.relaxed_bound``, ``parallel/relaxed_bound.py``); False
    refuses it by its roofline bound alone."""

    skip_by_bound: bool = True
    """Skip a logical mesh whose step-time bound is above a plan already found
    (``shard.plan_graph``, unless its caller says); False solves every mesh."""
